"""Environment workers (`env.workers=N`): rollouts run in N worker processes, each a verifiers `EnvServer` reached
through verifiers' `EnvClient` (ZMQ, msgpack), instead of in the orchestrator's event loop.

Why not verifiers' own `EnvServerPool`: it has no restart-on-death (a TODO there), so a dead worker's requests never
get a reply and new ones keep going to it. Here each worker is a single-process `serve_env` on its own ipc address,
and `EnvWorkers` supervises them.

Invariants:
- a rollout runs on one worker from start to end; a new rollout goes to the live worker with the fewest rollouts
  outstanding (ties: the lowest index), never to one that is starting or lost;
- a worker that exits (any code or signal) is lost; so is one that shows no sign of life (no health answer, no
  rollout finished) for `worker_timeout_s`, or `worker_grace_s` before its first rollout, backed off while fresh
  workers keep being lost (primerl.utils.liveness: a slow worker is not a dead one). A lost worker is killed with its
  whole process group, every rollout it held comes back at once as a `RolloutFailure` naming the worker and why, and a
  new one is started in its place (`restarts`), taking rollouts once it answers;
- an env that raises inside a rollout costs that rollout only: verifiers answers it as data;
- `MAX_START_FAILURES` workers in a row that are lost before they finish a rollout (before their first health
  answer, or at their first rollouts) end the run (`RunError`): that is a broken env or config, not a fault to ride
  out; the rollouts of a lost worker are marked `infrastructure`, which the orchestrator's failed-rollout streak (a bound
  on the env's failures) does not count;
- workers never outlive the orchestrator: each watches a pipe from it (verifiers' death pipe) and exits on its EOF,
  which a kill -9 of the orchestrator gives too.
"""

import asyncio
import itertools
import multiprocessing as mp
import shutil
import tempfile
import time
from typing import Any

import verifiers.v1 as vf

from primerl.envs.types import Rollout, RolloutFailure
from primerl.envs.verifiers_env import rollout_context
from primerl.envs.worker_process import (
    Worker,
    first_health_answer,
    health_check,
    start_worker,
    stop_worker,
)
from primerl.utils.errors import RunError
from primerl.utils.liveness import Liveness
from primerl.utils.log import get_logger
from primerl.utils.pool import HEALTH_EVERY_S, LOST, RestartBudget, least_outstanding, race
from primerl.utils.process import exit_reason
from primerl.utils.wait import WaitTimeout, wait_until_async

log = get_logger(__name__)

MAX_START_FAILURES = 3


class EnvWorkers:
    """N supervised env worker processes for one env (`config_data`: the verifiers env config dict of
    primerl.envs.verifiers_env.env_config). An async context manager; `supervisor` is the task to watch: it raises
    `RunError` when workers cannot start."""

    def __init__(
        self,
        name: str,
        config_data: dict,
        count: int,
        timeout_s: float,
        grace_s: float,
        startup_timeout_s: float = 300.0,
        task_type: type | None = None,
        scratch_prefix: str = "primerl-env-",
    ):
        if count < 1:
            raise ValueError(f"need at least one env worker, got {count}")
        self.name, self.config_data, self.count = name, config_data, count
        self.startup_timeout_s = startup_timeout_s
        self.liveness = Liveness(f"env workers of {name}", timeout_s, grace_s, tick_s=HEALTH_EVERY_S)
        self.workers: list[Worker | None] = [None] * count
        self.restarts = 0  # workers started again after one was lost, cumulative
        self.lost = 0  # rollouts failed because their worker was lost, cumulative
        self.supervisor: asyncio.Task | None = None
        self._live = asyncio.Event()
        self._error: str | None = None
        self._mp = mp.get_context("spawn")  # a fresh interpreter: no copy of the orchestrator's loop or sockets
        self._dir, self._scratch_prefix = "", scratch_prefix  # the workers' sockets: a temp dir of the run's own
        # a worker rebuilds each task from its data as the taskset's declared task type; a task of another class (a
        # taskset that yields a subclass it does not declare) would silently lose its behaviour there
        self.task_type = task_type

    @property
    def live_count(self) -> int:
        return sum(1 for w in self.workers if w is not None and w.live)

    async def __aenter__(self) -> "EnvWorkers":
        self._dir = tempfile.mkdtemp(prefix=self._scratch_prefix)
        keepers = [self._keep(i) for i in range(self.count)]
        self.supervisor = asyncio.create_task(self._supervise(keepers), name=f"env workers {self.name}")

        def all_up() -> bool:  # all of them up before the first rollout: a fair start
            if self.supervisor.done():
                self.supervisor.result()  # the supervisor's error ends the wait
            return self.live_count >= self.count

        try:
            await wait_until_async(all_up, f"{self.count} env worker(s) of {self.name}", self.startup_timeout_s, 0.1)
        except WaitTimeout as err:
            raise RunError(f"{err}: {self.live_count}/{self.count} up") from None
        log.info("%d env worker(s) serve %s", self.count, self.name)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.supervisor is not None:
            self.supervisor.cancel()
            await asyncio.gather(self.supervisor, return_exceptions=True)
        for worker in self.workers:
            if worker is not None:
                await stop_worker(worker, "the orchestrator is closing")
        shutil.rmtree(self._dir, ignore_errors=True)

    def pick(self) -> Worker | None:
        workers = [w for w in self.workers if w is not None]
        index = least_outstanding([w.outstanding for w in workers], [w.live for w in workers])
        return None if index is None else workers[index]

    async def run(self, ctx: vf.ModelContext, task: Any) -> list[Rollout | RolloutFailure]:
        """One rollout of `task` on a live worker, sampling with `ctx`. Never raises for the env's or a worker's
        faults: they come back as `RolloutFailure`s."""
        if self.task_type is not None and type(task) is not self.task_type:
            return [
                RolloutFailure(
                    f"env {self.name}: its taskset yields {type(task).__name__} but declares "
                    f"{self.task_type.__name__}, which a worker would run instead"
                )
            ]
        while (worker := self.pick()) is None:
            if self._error:
                return [RolloutFailure(self._error)]
            self._live.clear()
            await self._live.wait()
        worker.outstanding += 1
        try:
            rollouts = await race(self._request(worker, ctx, task), worker.gone)
        finally:
            worker.outstanding -= 1
        if rollouts is LOST:
            self.lost += 1
            return [RolloutFailure(f"env worker {worker.index} lost: {worker.gone.result()}", infrastructure=True)]
        return rollouts

    async def _request(self, worker: Worker, ctx: vf.ModelContext, task: Any) -> list[Rollout | RolloutFailure]:
        """The worker's rollouts of `task`, or a RolloutFailure for a request it answered but could not run."""
        try:
            rollouts = await worker.client.rollouts(ctx, task.data.model_dump(mode="json"))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the server's answer to a request it could not run
            self.liveness.finished(worker.pulse)  # an answer, whatever it says, is a sign of life
            return [RolloutFailure(f"env worker {worker.index}: {str(err).splitlines()[0][:300]}")]
        self.liveness.finished(worker.pulse)
        return rollouts

    async def _supervise(self, keepers: list) -> None:
        """Run every worker's keeper; the first that raises ends them all (gather alone would leave the others
        running, unowned, starting workers after the pool closed)."""
        tasks = [asyncio.ensure_future(keeper) for keeper in keepers]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, index: int) -> None:
        """Keep worker `index` running: start it, watch it, and start it again whenever it is lost."""
        budget = RestartBudget(f"env worker {index} of {self.name}", MAX_START_FAILURES)
        for incarnation in itertools.count():
            worker = self.workers[index] = start_worker(self._mp, self._dir, self.config_data, index, incarnation)
            reason = await self._watch(worker)
            was_live = worker.live
            await stop_worker(worker, reason)
            lost = (
                f"env worker {index} of {self.name} lost after {worker.served} rollouts ({reason}); starting it again"
            )
            if was_live and worker.served:
                budget.served()
                log.warning(lost)
            elif was_live:  # lost at its first rollouts: an env that kills every worker so is not ridden out for ever
                log.warning(f"{lost}, {budget.failed_in_a_row + 1}/{MAX_START_FAILURES} in a row before finishing one")
                self._fail(budget, reason)
            else:
                log.warning(
                    f"env worker {index} of {self.name} failed to start ({reason}), "
                    f"{budget.failed_in_a_row + 1}/{MAX_START_FAILURES}"
                )
                self._fail(budget, f"{reason} (its log lines are above)")
            self.restarts += 1

    def _fail(self, budget: RestartBudget, reason: str) -> None:
        """One more start in a row that did not serve; past the budget, the pool's error, which waiting rollouts
        see, ends the run."""
        try:
            budget.failed(reason)
        except RunError as err:
            self._error = str(err)
            self._live.set()
            raise

    async def _watch(self, worker: Worker) -> str:
        """Until `worker` is lost; returns why. Marks it live at its first health answer."""
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(worker.process.sentinel, lambda: died.done() or died.set_result(None))
        probe = asyncio.ensure_future(first_health_answer(worker, self.startup_timeout_s))
        try:
            await asyncio.wait([probe, died], return_when=asyncio.FIRST_COMPLETED)
            if not died.done() and not probe.result():
                return f"no answer to a health check in {self.startup_timeout_s:.0f}s of start-up"
            if not died.done():
                worker.live = True
                self._live.set()
                log.info(
                    "env worker %d of %s is up (pid %d, %.1fs)",
                    worker.index,
                    self.name,
                    worker.process.pid,
                    time.monotonic() - worker.started,
                )
            last = time.monotonic()
            while not died.done():
                if probe.done():  # one health check in flight at a time; its answer is a sign of life
                    probe = asyncio.ensure_future(health_check(worker, self.liveness.limit(worker.pulse)))
                await asyncio.wait([died], timeout=HEALTH_EVERY_S)
                now = time.monotonic()
                elapsed, last = now - last, now
                if not died.done() and self.liveness.observe(worker.pulse, elapsed):
                    limit = self.liveness.limit(worker.pulse)
                    self.liveness.lost(worker.pulse)  # silent, not crashed: what the grace backs off for
                    return f"no health answer or finished rollout in {limit:.0f}s"
            # the sentinel fires as the process's pipes close, which can be before it can be reaped
            await asyncio.to_thread(worker.process.join, 5)
            return exit_reason(worker.process.exitcode)
        finally:
            probe.cancel()
            loop.remove_reader(worker.process.sentinel)


class WorkerRunner:
    """The orchestrator's `RolloutRunner` over env workers: one per inference replica (its `ctx`), sharing the pool;
    `journaled` as for primerl.envs.verifiers_env.EnvRunner."""

    def __init__(self, workers: EnvWorkers, ctx: vf.ModelContext, journaled: bool = False):
        self.workers, self.ctx, self.journaled = workers, ctx, journaled

    async def run(self, task: Any, seed: int | None = None) -> list[Rollout | RolloutFailure]:
        return await self.workers.run(rollout_context(self.ctx, seed, self.journaled), task)
