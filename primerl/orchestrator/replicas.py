"""Inference replicas: which are up, how many rollouts each is running, and the runner that spreads rollouts over them.

`Replicas` is the orchestrator's one view of its N inference servers (`inference.replicas`); the watcher marks them
down and up (primerl.orchestrator.watcher), `ReplicaRunner` picks one per rollout.

Invariants:
- a rollout runs on one replica from its first turn to its last (the replica's prefix cache holds its earlier turns);
- a new rollout goes to the up replica with the fewest rollouts outstanding (ties: the lowest index), never to one
  marked down (the pool policy of primerl.utils.pool);
- a rollout whose every trace failed is checked against its replica's health: when the replica refuses it (nothing
  listens, an error status), it is marked down and the rollout runs again, from the start, on another up replica
  (counted in `rerouted`); a rollout is run at most once per replica. Failures on a replica that is up, or only slow
  to answer (the watcher weighs that: `liveness`), are the env's, and stay failures;
- a replica's signs of life are its health answers and the rollouts it finishes (`pulses`); the watcher marks one
  down that has shown neither for `liveness`'s limit, so a loaded replica is not taken for a dead one;
- a rollout in flight on a replica that is marked down (by the watcher's health checks, or another rollout's failure)
  is cancelled and runs again elsewhere at once (counted in `rerouted`): it does not wait out its client's retries
  against a dead server, which can take longer than `orchestrator.rollout_timeout_s`.
"""

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from primerl.envs.types import Rollout, RolloutFailure, RolloutRunner
from primerl.orchestrator.inference_client import InferenceClient
from primerl.utils.liveness import Liveness, Pulse
from primerl.utils.log import get_logger
from primerl.utils.pool import HEALTH_EVERY_S, LOST, LeastLoaded, race

log = get_logger(__name__)
SILENT_LIMIT_S = 15.0  # no health answer and no finished rollout for this long: down


class Replicas:
    def __init__(self, clients: Sequence[InferenceClient]):
        if not clients:
            raise ValueError("need at least one inference replica")
        self.clients = list(clients)
        self.load = LeastLoaded(len(clients))  # the pick among up replicas, in O(log n)
        self.up, self.outstanding = self.load.taking, self.load.outstanding  # read-only views: write through `load`
        self.rerouted = 0  # rollouts run again on another replica after theirs went down, cumulative
        self.down_event = asyncio.Event()  # set by mark_down: the watcher starts that replica's recovery
        self._went_down = [asyncio.Event() for _ in clients]  # per replica: set while it is down
        self.pulses = [Pulse() for _ in clients]
        self.liveness = Liveness("inference replicas", SILENT_LIMIT_S, SILENT_LIMIT_S, tick_s=HEALTH_EVERY_S)
        self.on_move: list[Callable[[int, str], None]] = []  # told when a replica moves to another address
        self.down: set[int] = set()  # the replicas marked down: what per-tick work walks instead of all of them
        self._polled = -1  # the replica running_requests read last

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def serving(self) -> bool:
        return len(self.down) < len(self.clients)

    @property
    def up_count(self) -> int:
        return len(self.clients) - len(self.down)

    def pick(self, exclude: set[int] = frozenset()) -> int | None:
        """The up replica with the fewest outstanding rollouts, not in `exclude`; None when there is none."""
        return self.load.pick(exclude)

    def mark_down(self, index: int, why: str) -> None:
        if self.up[index]:
            self.load.set_taking(index, False)
            self.down.add(index)
            log.warning("inference replica %d (%s) is down: %s", index, self.clients[index].base_url, why)
            self._went_down[index].set()
            self.down_event.set()

    def mark_up(self, index: int) -> None:
        self.load.set_taking(index, True)
        self.down.discard(index)
        self.pulses[index] = Pulse()
        self._went_down[index].clear()

    async def wait_down(self, index: int) -> None:
        await self._went_down[index].wait()

    def advertised_elsewhere(self, index: int, urls: list[str | None] | None) -> str | None:
        """The address replica `index` is advertised at in `urls` (its inference job's), when that is not where its
        client points: the job was requeued, to another node or port."""
        url = urls[index] if urls and index < len(urls) else None
        return url if url and url != self.clients[index].base_url else None

    def move(self, index: int, base_url: str) -> None:
        """Replica `index` now serves at `base_url` (a requeued SLURM job on another node or port); only while down."""
        assert not self.up[index], "a replica moves only while it is down"
        log.warning("inference replica %d moved: %s -> %s", index, self.clients[index].base_url, base_url)
        self.clients[index].move_to(base_url)
        for listener in self.on_move:
            listener(index, base_url)

    async def running_requests(self) -> float | None:
        """vLLM's running requests on the next up replica in turn (None when none is up or it could not be read):
        one request per call however many replicas there are (asking all of them at each poll cost the
        orchestrator a fifth of its CPU against 4 stand-in replicas, benchmarks/capacity.py)."""
        if not self.serving:
            return None
        count = len(self)
        self._polled = next(i % count for i in range(self._polled + 1, self._polled + 1 + count) if self.up[i % count])
        return await self.clients[self._polled].running_requests()


class ReplicaRunner:
    """A `RolloutRunner` over per-replica runners (`runners[i]` sends its requests to replica i). With `make_runner`
    (a replica's base URL -> its runner), a replica that moves gets a new runner for its new address."""

    def __init__(
        self,
        runners: Sequence[RolloutRunner],
        replicas: Replicas,
        make_runner: Callable[[str], RolloutRunner] | None = None,
    ):
        if len(runners) != len(replicas):
            raise ValueError(f"{len(runners)} runners for {len(replicas)} replicas")
        self.runners, self.replicas = list(runners), replicas
        if make_runner is not None:
            replicas.on_move.append(lambda index, url: self.runners.__setitem__(index, make_runner(url)))

    async def run(self, task: Any, seed: int | None = None) -> list[Rollout | RolloutFailure]:
        tried: set[int] = set()
        entries: list[Rollout | RolloutFailure] = []
        while (index := self.replicas.pick(tried)) is not None:
            tried.add(index)
            entries = await self._run_on(index, task, seed)
            if entries is None:  # its replica went down under it
                entries = [RolloutFailure(f"inference replica {index} went down during the rollout")]
            elif any(isinstance(e, Rollout) for e in entries):
                self.replicas.liveness.finished(self.replicas.pulses[index])
                return entries
            elif await self.replicas.clients[index].health() is not False:
                return entries
            else:
                self.replicas.mark_down(index, f"a rollout failed ({_first_reason(entries)}) and /health refused")
            if self.replicas.pick(tried) is not None:
                self.replicas.rerouted += 1
        return entries or [RolloutFailure("no inference replica is up")]

    async def _run_on(self, index: int, task: Any, seed: int | None) -> list[Rollout | RolloutFailure] | None:
        """The rollout's entries from replica `index`; None, the rollout cancelled, if the replica is marked down first."""
        self.replicas.load.change(index, +1)
        try:
            entries = await race(self.runners[index].run(task, seed), self.replicas.wait_down(index))
        finally:
            self.replicas.load.change(index, -1)
        return None if entries is LOST else entries


def _first_reason(entries: list[Rollout | RolloutFailure]) -> str:
    return next((e.reason[:120] for e in entries if isinstance(e, RolloutFailure)), "no trace")
