"""Recovery: brings each inference replica marked down back to serving the policy the others serve.

A replica marked down (by the watcher's probe, a failed load, or the runner) gets a task that waits for it with
back-off (following it to a new address when its SLURM job was requeued: `addresses`), makes it serve the target
version (resuming it: a load cut short on the orchestrator's side leaves the server paused), and marks it up. The
target is the version the replicas that are up serve; with none up, the newest published (a restarted server serves
v0). A target that went by collective (primerl.transport.collective) is in no
file: the replica joins the watcher's next offer instead (`joining`: the watcher includes it in that load and
settles its future) and is up once it took it. With no replica up and that version's offer already answered,
nothing can send it again: the run stops (RunError), and a rerun resumes from the trainer's checkpoint.

A replica still down after `recovery_timeout_s` ends the run only when no other replica is up; otherwise it keeps
waiting while the others serve.
"""

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx

from primerl.orchestrator.arrival import Arrival
from primerl.orchestrator.inference_client import NotProven
from primerl.orchestrator.replicas import Replicas
from primerl.orchestrator.types import Policy
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import is_offer, latest_stable_version
from primerl.utils.errors import RunError
from primerl.utils.log import get_logger

log = get_logger(__name__)


class Recovery:
    def __init__(
        self,
        run_dir: Path,
        replicas: Replicas,
        policy: Policy,
        arrival: Arrival,
        recovery_timeout_s: float,
        addresses: Callable[[], list[str | None] | None],
        wake: Callable[[], None],
        on_change: Callable[[], None],
    ):
        """`wake`: make the watcher poll now (an offer may wait for a joining replica). `on_change`: a replica is
        back (the orchestrator wakes its dispatcher)."""
        self.run_dir, self.replicas, self.policy, self.arrival = run_dir, replicas, policy, arrival
        self.recovery_timeout_s, self.addresses = recovery_timeout_s, addresses
        self.wake, self.on_change = wake, on_change
        self.recovered = 0  # replicas brought back, cumulative
        self.joining: dict[int, asyncio.Future[bool]] = {}  # replicas waiting for the next offer: whether they took it
        self._tasks: dict[int, asyncio.Task] = {}

    def start(self) -> None:
        """A recovery task for every replica that is down and has none."""
        for index in self.replicas.down:
            if index not in self._tasks:
                self._tasks[index] = asyncio.create_task(self._recover(index), name=f"recover-replica-{index}")

    def raise_failed(self) -> None:
        """Forget finished tasks; raise the error of one that ended the run (no replica came back, none up)."""
        for index, task in list(self._tasks.items()):
            if task.done():
                del self._tasks[index]
                task.result()

    def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    def settle(self, index: int, took: bool) -> None:
        """Joining replica `index` took the offer it joined, or did not (it joins the next)."""
        if index in self.joining:
            self.joining.pop(index).set_result(took)

    def _follow(self, index: int) -> None:
        """Point down replica `index` at its advertised address when that changed (its job was requeued)."""
        if url := self.replicas.advertised_elsewhere(index, self.addresses()):
            self.replicas.move(index, url)

    async def _join_next(self, index: int) -> bool:
        """Wait until the next offer's load included replica `index`; whether it took it."""
        self.joining[index] = asyncio.get_running_loop().create_future()
        self.wake()
        try:
            return await self.joining[index]
        finally:
            self.joining.pop(index, None)

    async def _catch_up(self, index: int, served: int, target: int) -> bool:
        """Make replica `index` serve `target` (or, when `target` went by collective, the next offer). Returns
        whether it joined an offer (it then serves `policy.version`)."""
        client = self.replicas.clients[index]
        path = weights_path(self.run_dir, target)
        if is_offer(path):
            if not self.replicas.serving and self.arrival.answered(target):
                raise RunError(
                    f"every inference replica lost policy v{target}, which went by collective "
                    "(weights.transport=collective) and is nowhere else; rerun the same command to resume: the "
                    "trainer offers its checkpoint's policy again"
                )
            log.warning("the server serves policy v%d; v%d went by collective: it joins the next offer", served, target)
            while not await self._join_next(index):
                await client.wait_healthy(self.recovery_timeout_s, lambda: self._follow(index))
            return True
        log.warning("the server serves policy v%d, not v%d: reloading", served, target)
        try:
            await client.load_weights(path, target)
        except NotProven:
            self.arrival.mismatches += 1
            raise
        return False

    async def _recover(self, index: int) -> None:
        """Wait for replica `index`, make it serve the policy the others serve, mark it up."""
        client = self.replicas.clients[index]
        log.warning("inference server %s unreachable; waiting with back-off", client.base_url)
        while True:
            try:
                await client.wait_healthy(self.recovery_timeout_s, lambda: self._follow(index))
                target = self.policy.version if self.replicas.serving else (latest_stable_version(self.run_dir) or 0)
                served = await client.policy_version()
                if served != target and await self._catch_up(index, served, target):
                    break  # joined an offer: it serves policy.version, which the watcher's load set
                if self.replicas.serving and target != self.policy.version:
                    continue  # the others moved on meanwhile: load theirs
                if served == target:  # it proved `target`; a load cut on our side (a straggler) left it paused
                    await client.resume()
                if not self.replicas.serving:
                    self.policy.version = target
                break
            except RunError:
                if not self.replicas.serving:
                    raise
                log.warning(
                    "inference server %s still down after %.0fs; the other replicas serve",
                    client.base_url,
                    self.recovery_timeout_s,
                )
            except (httpx.HTTPError, RuntimeError) as err:
                log.warning("inference server %s: %s; waiting again", client.base_url, err)
                await asyncio.sleep(1.0)
        self.replicas.mark_up(index)
        self.recovered += 1
        log.info("inference server %s is back, serving v%d", client.base_url, self.policy.version)
        self.on_change()
