"""Watcher: follows the trainer's published policies into the inference replicas, and the replicas' health.

Every `poll_s` it looks for a newer STABLE weights directory; when there is one it loads the newest into every
replica that is up, concurrently and in flight (pause with requests kept, load, resume:
primerl.orchestrator.inference_client), then advances `Policy` and calls `on_change` (the orchestrator re-checks its
batch cut and wakes the dispatcher). Versions in between are skipped: a server only ever needs the newest.

Health (primerl.orchestrator.health): each up replica that showed no other sign of life (a finished rollout, a load
it answered) is probed about once per HEALTH_EVERY_S, a slice of them per tick, during a load too; every up replica after a group whose every rollout failed
(`check_health()`) and after a failed load. One that refuses (nothing listens, an error status), or has shown no sign of
life for the replicas' liveness limit, is marked down and gets new rollouts no more; a load in flight to it is cut (a
node lost mid-load answers nothing, and would hold the version for the load's whole timeout). A replica marked down
(here, or by the runner) is brought back in the background (primerl.orchestrator.recovery). While no replica is up,
admission stops (`serving` false). Invariant: every replica marked up serves `Policy.version`. Rollouts that failed
meanwhile are counted failures; no step is skipped.

Collective offers (primerl.transport.collective): every offer gets an answer, the groups of the replicas that take
it (none when every replica serves it already), or the trainer would wait for ever. A replica that comes back while
the others serve a version sent by collective cannot read that version anywhere: it joins the next offer (its
recovery waits in `Recovery.joining`) and is marked up once that load succeeded.

Proof of arrival: a replica resumes only after its workers proved the load (the fingerprint of what they serve is
the trainer's: primerl.inference.worker_extension); one that could not is left paused, logged with both values,
loaded again (a file; an offer cannot be sent twice), and taken out, still paused, if it still cannot: its recovery
loads it anew.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx

from primerl.orchestrator.arrival import Arrival
from primerl.orchestrator.fanout import FILE_LOADS_AT_ONCE, Straggler, fan_out
from primerl.orchestrator.health import Health
from primerl.orchestrator.inference_client import NotProven
from primerl.orchestrator.recovery import Recovery
from primerl.orchestrator.replicas import Replicas
from primerl.orchestrator.types import Policy
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import (
    is_offer,
    latest_stable_version,
)
from primerl.utils.errors import RunError
from primerl.utils.log import get_logger
from primerl.utils.pool import LOST, race

log = get_logger(__name__)
MAX_LOAD_FAILURES = 3  # in a row, on replicas that answer /health: weights they refuse end the run
T = TypeVar("T")


class ReplicaLost(RuntimeError):
    """A replica's load cut because the replica was marked down meanwhile."""


class Watcher:
    def __init__(
        self,
        run_dir: Path,
        replicas: Replicas,
        policy: Policy,
        poll_s: float,
        recovery_timeout_s: float,
        on_change: Callable[[], None] = lambda: None,
        before_load: Callable[[int], Awaitable[None]] | None = None,
        addresses: Callable[[], list[str | None] | None] = lambda: None,
        transfer_timeout_s: float = 300.0,
    ):
        self.run_dir, self.replicas, self.policy = run_dir, replicas, policy
        self.poll_s, self.on_change = poll_s, on_change
        self.before_load = before_load  # awaited with the served version before a newer one is loaded (online evals)
        self.load_s = 0.0  # seconds the slowest replica spent loading weights, summed over loads
        self.fanout_s = 0.0  # seconds from a version's first load request to every replica serving it, summed
        self.loads = 0
        self.transfer_timeout_s = transfer_timeout_s  # weights.timeout_s
        self.arrival = Arrival(run_dir, replicas.clients, transfer_timeout_s)
        self._suspect = asyncio.Event()
        # `on_change` read when called: the orchestrator sets it after building the watcher
        back = lambda: self.on_change()  # noqa: E731
        self.recovery = Recovery(
            run_dir, replicas, policy, self.arrival, recovery_timeout_s, addresses, self._suspect.set, back
        )
        self._load_failures = 0
        self.health = Health(replicas)

    @property
    def mismatches(self) -> int:
        """Loads whose fingerprint differed from the trainer's, cumulative."""
        return self.arrival.mismatches

    @property
    def recoveries(self) -> int:
        """Replicas brought back, cumulative."""
        return self.recovery.recovered

    @property
    def serving(self) -> bool:
        """False while no replica is up: the orchestrator admits nothing."""
        return self.replicas.serving

    def check_health(self) -> None:
        """Ask for a health check at the next poll (e.g. after a group whose rollouts all failed)."""
        self._suspect.set()

    async def run(self) -> None:
        try:
            while True:
                self.recovery.raise_failed()
                try:
                    if self._suspect.is_set():
                        self._suspect.clear()
                        await self.probe()
                    else:
                        await self.probe(self.health.due())
                    await self._to_the_end(self._probing(self.update()))
                except (httpx.HTTPError, RuntimeError) as err:
                    self._load_failures += 1
                    if self._load_failures >= MAX_LOAD_FAILURES:
                        raise RunError(
                            f"loading new weights failed {self._load_failures} times in a row on "
                            f"replicas that are up: {type(err).__name__}: {err}"
                        ) from err
                    log.warning("weight update failed (%s: %s); checking the servers", type(err).__name__, err)
                    await self.probe()
                self.recovery.start()
                self.replicas.down_event.clear()
                waits = [asyncio.ensure_future(e.wait()) for e in (self._suspect, self.replicas.down_event)]
                await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                for waiting in waits:
                    waiting.cancel()
        finally:
            self.recovery.cancel()

    async def _to_the_end(self, update: Awaitable[None]) -> None:
        """Run an update to its end even when the watcher is cancelled meanwhile (the orchestrator is done): an offer
        it answered must be taken, or the trainer would wait for workers that never join. Bounded by the
        transfer's own limits; then the cancellation goes through."""
        task = asyncio.ensure_future(update)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task], timeout=2 * self.transfer_timeout_s + 30)
            raise

    async def _probing(self, update: Awaitable[None]) -> None:
        """`update`, with the health round going on meanwhile: a replica that goes silent during a load (its node
        lost: no answer and no refusal, so its load would wait out its whole timeout) is marked down within its
        liveness limit, and its load is cut (`_while_up`). Its recovery starts after the update."""
        task = asyncio.ensure_future(update)
        while not task.done():
            await asyncio.wait([task], timeout=self.poll_s)
            if not task.done():
                await self.health.probe(self.health.due())
        task.result()

    async def _while_up(self, index: int, load: Awaitable[T]) -> T:
        """`load` of replica `index`, cut with ReplicaLost if the replica, up when it began, is marked down first."""
        if not self.replicas.up[index]:  # a joining replica: nothing to watch
            return await load
        result = await race(load, self.replicas.wait_down(index))
        if result is LOST:
            raise ReplicaLost(f"inference replica {index} went down during the load")
        return result

    async def probe(self, indices: list[int] | None = None) -> None:
        """Health-check `indices` (None: every up replica), then start the recovery of any marked down."""
        await self.health.probe(indices)
        self.recovery.start()

    async def update(self) -> None:
        """Load the newest published policy into every up replica (and every joining one) if it is newer than the
        one served; answer an offer of the version served with the replicas still joining (or none)."""
        latest = latest_stable_version(self.run_dir)
        if latest is None:
            return
        if latest <= self.policy.version:
            if is_offer(weights_path(self.run_dir, latest)) and not self.arrival.answered(latest):
                await self._load(latest, joining_only=True)
            return
        if not self.replicas.serving and not self.recovery.joining:
            return  # an offer stays unanswered (the trainer waits) until a replica is back to take it
        if self.before_load is not None and self.replicas.serving:
            await self.before_load(self.policy.version)
            latest = latest_stable_version(self.run_dir) or latest  # the trainer may have published more meanwhile
        await self._load(latest)

    async def _load(self, version: int, joining_only: bool = False) -> None:
        up = [] if joining_only else [i for i in range(len(self.replicas)) if self.replicas.up[i]]
        targets = up + [i for i in self.recovery.joining if i not in up]
        path = weights_path(self.run_dir, version)
        groups = await self.arrival.answer(version, targets, self._fail) if is_offer(path) else {}
        if is_offer(path):
            targets = [i for i in targets if i in groups]
        started = time.monotonic()
        results = await fan_out(
            targets,
            lambda i: self._while_up(i, self.replicas.clients[i].load_weights(path, version, groups.get(i, ""))),
            None if groups else FILE_LOADS_AT_ONCE,
        )
        loaded = []
        for index, result in results.items():
            if isinstance(result, ReplicaLost):
                continue  # marked down by the health round; its recovery follows
            if isinstance(result, Straggler):
                self._fail(index, f"v{version} {result}")
                continue
            if isinstance(result, NotProven):
                result = await self.arrival.prove_again(index, version, result, not groups, self._fail)
            elif isinstance(result, BaseException):
                if not groups and (
                    not isinstance(result, (httpx.HTTPError, RuntimeError))
                    or await self.replicas.clients[index].healthy()
                ):
                    raise result  # a server that is up and refuses the weights: not a fault to wait out
                self._fail(index, f"the load of v{version} failed ({type(result).__name__}: {result})")
                continue
            if result is not None:
                loaded.append(result)
                self.replicas.pulses[index].answered()  # a sign of life: no /health probe needed for a while
                self.recovery.settle(index, took=True)
        if loaded:
            self._advance(version, max(result.seconds for result in loaded), time.monotonic() - started, len(loaded))

    def _advance(self, version: int, seconds: float, fanout_s: float, count: int) -> None:
        if version == self.policy.version:
            return
        log.info(
            "policy v%d -> v%d loaded in flight in %.2fs (%d replica%s, the slowest paused %.2fs)",
            self.policy.version,
            version,
            fanout_s,
            count,
            "" if count == 1 else "s",
            seconds,
        )
        self.policy.version = version
        self._load_failures = 0
        self.load_s += seconds
        self.fanout_s += fanout_s
        self.loads += 1
        self.on_change()

    def _fail(self, index: int, reason: str) -> None:
        """Replica `index` did not take a version: a joining one waits for the next offer, an up one is taken out."""
        if index in self.recovery.joining:
            log.warning(
                "inference server %s: %s; it joins the next offer", self.replicas.clients[index].base_url, reason
            )
            self.recovery.settle(index, took=False)
        elif self.replicas.up[index]:
            self.replicas.mark_down(index, reason)
