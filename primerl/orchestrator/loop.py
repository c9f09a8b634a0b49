"""The orchestrator: continuous rollouts in, one trainer batch per step out.

    TaskSource -> Dispatcher ==(FinishedGroup | CancelledGroup)==> Sink --(Cut)--> BatchWriter -> rollouts/step_<n>
                      ^  keeps up to max_inflight rollouts in flight     ^ drops samples past max_off_policy_steps
                      |  under the pacing budget (pacing.py)             |
    Watcher: weights/step_<v> -> pause, load, resume the server -> Policy.version = v -> re-check the cut, wake

Components hold no reference to each other; primerl.orchestrator.orchestrator wires them, this module runs the cut
loop (`Orchestrator.run`). Each cut's metrics row: primerl.orchestrator.stats.

Pacing (`may_admit`, primerl.orchestrator.pacing): with policy v served, batches up to v + async_level may be cut,
and the dispatcher admits groups only while they fit in those batches. Batch n is cut as soon as `batch_size`
fresh-enough samples are buffered and policy n - async_level is served. After each cut, in-flight groups that can no
longer be trained (dispatched under a version older than next_step - max_off_policy_steps) are cancelled. With
`drain_per_step` a batch is cut when every one of its groups has finished.

Online evals (`eval.every`, primerl.orchestrator.online_eval) score the served policy on held-out envs: the watcher
awaits the eval of version v, when one is due, before it loads a newer policy.

Tasks: each batch records which drawn tasks it trained, which ended untrained since the previous batch, and which
are pending (in flight or buffered); a restarted orchestrator runs the pending ones again first
(primerl.orchestrator.accounting).

Failures are data: a failed rollout is counted; a group whose every rollout failed asks the watcher to check the
server; `max_failed_streak` failed rollouts in a row with no success, the server up, stop the run with the logged
reasons. Rollouts that a process of the run failed (a lost env worker, the teacher: `RolloutFailure.infrastructure`)
are not the env's failures and are not counted there (the worker pool bounds its own restarts, primerl.envs.workers;
the inference process its servers'); with the default bounds a silent worker is found (env.worker_timeout_s, 30 s)
before its rollouts time out (orchestrator.rollout_timeout_s, 120 s).
"""

import asyncio
import collections
import time

from primerl.config.orchestrator import OrchestratorConfig
from primerl.envs.types import RolloutRunner
from primerl.metrics import OrchestratorMetric as M
from primerl.orchestrator.admission import KvAdmission
from primerl.orchestrator.dispatcher import Dispatcher
from primerl.orchestrator.episodes import EpisodeJournals
from primerl.orchestrator.pacing import Pacing
from primerl.orchestrator.sink import Cut, Sink
from primerl.orchestrator.source import TaskSource
from primerl.orchestrator.stats import CutMeter
from primerl.orchestrator.types import AlwaysServing, CancelledGroup, FinishedGroup, Policy, Servers
from primerl.orchestrator.writer import BatchWriter
from primerl.utils.errors import RunError, writing
from primerl.utils.log import get_logger

log = get_logger("orchestrator")


class Orchestrator:
    """The cut loop over a dispatcher and a sink. `writer` writes each batch; `policy` is advanced from outside (the
    watcher, or a test), which then calls `notify()`."""

    def __init__(
        self,
        cfg: OrchestratorConfig,
        max_steps: int,
        source: TaskSource,
        runner: RolloutRunner,
        writer: BatchWriter,
        policy: Policy,
        start_step: int = 0,
        servers: Servers | None = None,
        meter: CutMeter | None = None,
        sampling_seed: int | None = None,
        admission: KvAdmission | None = None,
        reward_weight: float = 1.0,
        distill_coef: float = 1.0,
        journals: EpisodeJournals | None = None,
    ):
        self.cfg, self.max_steps, self.source, self.writer, self.policy = cfg, max_steps, source, writer, policy
        self.step = start_step  # the next batch to cut
        self.servers = servers or AlwaysServing()
        self.admission = admission  # None: orchestrator.max_inflight alone bounds what is in flight
        self.pacing = Pacing(cfg, max_steps, policy, self.servers, admission)
        self.meter = meter or CutMeter()
        self.sink = Sink(
            cfg.batch_size,
            cfg.off_policy_bound,
            advantage=cfg.advantage,
            group_filter=cfg.filter,
            reward_weight=reward_weight,
            distill_coef=distill_coef,
        )
        self.dispatcher = Dispatcher(
            source,
            runner,
            policy,
            cfg.group_size,
            cfg.max_inflight,
            cfg.rollout_timeout_s,
            self._deliver,
            self.may_admit,
            sampling_seed,
            journals,
            self._oldest_usable,
        )
        self.journals = journals
        # an environment that fails every rollout for 5 batches' worth stops the run; a server that dies can fail what
        # is in flight and its replacements before the watcher notices (2 x max_inflight), and resets the count
        self.max_failed_streak = 5 * cfg.batch_size + 2 * cfg.max_inflight
        self._changed = asyncio.Event()
        self._failed_streak = 0
        self._recoveries_seen = 0
        self._error: Exception | None = None  # found in a delivery callback, raised by the cut loop
        self._failure_reasons: collections.Counter[str] = collections.Counter()

    def notify(self) -> None:
        """Something changed (a group finished, the policy advanced, the server came back): re-check and re-admit."""
        self._changed.set()
        self.dispatcher.wake()

    def _oldest_usable(self) -> int:
        return self.pacing.oldest_usable(self.step, self.dispatcher.inflight_rollouts, self.sink.buffered)

    def may_admit(self, n: int) -> bool:
        d = self.dispatcher
        return self.pacing.may_admit(n, self.step, d.inflight_rollouts, self.sink.buffered, d.counts.dispatched)

    async def run(self) -> None:
        if self.journals is not None:  # those of tasks a kill left trained or spent, before it removed them
            self.journals.begin(self.source.owed_tasks, self.source.position)
            self.source.run_first(self.journals.newest_first)
        dispatching = asyncio.create_task(self.dispatcher.run(), name="dispatcher")
        lag = asyncio.create_task(self.meter.loop_lag.run(), name="loop-lag")
        try:
            while self.step < self.max_steps:
                await self._changed.wait()
                self._changed.clear()
                if self._error is not None:
                    raise self._error
                while self.step < self.max_steps and (cut := self._try_cut()) is not None:
                    await self._write(cut)
                self.dispatcher.wake()  # a cut, or a drop of stale samples at a cut that then fell short, frees room
                if dispatching.done() and not self.dispatcher.groups and self.step < self.max_steps:
                    dispatching.result()  # re-raises a dispatcher error
                    if self.sink.buffered < self.cfg.batch_size and self.source.exhausted:
                        raise RunError(f"the task stream ran out at step {self.step} of {self.max_steps}")
        finally:
            lag.cancel()
            await self.dispatcher.stop("the run has all its batches" if self.step >= self.max_steps else "stopping")
            dispatching.cancel()
        ok, failed, cancelled = self._rollout_counts()
        log.info(
            "done: %d batches; rollouts dispatched %d = ok %d + failed %d + cancelled %d",
            self.step,
            self.dispatcher.counts.dispatched,
            ok,
            failed,
            cancelled,
        )

    def _rollout_counts(self) -> tuple[int, int, int]:
        c = self.dispatcher.counts
        return c.ok, c.failed, c.cancelled

    def _deliver(self, item: FinishedGroup | CancelledGroup) -> None:
        """Called by the dispatcher as each group ends: a finished group goes to the sink at once."""
        self._changed.set()
        if isinstance(item, CancelledGroup):
            log.debug("group %d (policy v%d) cancelled: %s", item.group_id, item.version, item.reason)
            return
        self._failure_reasons.update(item.failures)
        self.meter.rollout_seconds += item.seconds
        if item.ok_rollouts:
            self._failed_streak = 0
            self.sink.add(item)
            return
        self.servers.check_health()
        if not self.servers.serving:
            return  # the server is down: its failures say nothing about the environment
        if self.servers.recoveries != self._recoveries_seen:
            self._recoveries_seen, self._failed_streak = self.servers.recoveries, 0
        # rollouts that a process of the run failed (a lost env worker, the teacher) say nothing about the env, and
        # each such process has its own bound; they are not successes either, so they neither add to nor reset it
        self._failed_streak += item.failed_rollouts - item.lost_rollouts
        if self._failed_streak >= self.max_failed_streak and self._error is None:
            reasons = "; ".join(f"{count}x {reason[:200]}" for reason, count in self._failure_reasons.most_common(3))
            self._error = RunError(
                f"{self._failed_streak} rollouts in a row failed (environment, reward function or server); the most "
                f"common reasons since the last batch: {reasons or 'none recorded'}"
            )

    def _try_cut(self) -> Cut | None:
        cfg = self.cfg
        if cfg.drain_per_step:
            ready = self.dispatcher.inflight_rollouts == 0 and self.sink.buffered > 0
        else:
            ready = self.sink.buffered >= cfg.batch_size
        if not ready:
            return None
        if self.policy.version < self.step - cfg.async_level:
            self.meter.blocked_since = self.meter.blocked_since or time.perf_counter()
            return None
        return self.sink.cut_all(self.step) if cfg.drain_per_step else self.sink.cut(self.step)

    async def _write(self, cut: Cut) -> None:
        now_gauges = {
            M.POLICY_VERSION: float(self.policy.version),
            M.INFLIGHT: float(self.dispatcher.inflight_rollouts),
            M.BUFFERED: float(self.sink.buffered),
        }
        if self.admission is not None:
            now_gauges[M.INFLIGHT_LIMIT] = float(self.admission.total())
        stats = self.meter.row(cut, self._rollout_counts(), (self.servers.load_s, self.servers.fanout_s), now_gauges)
        tasks = self.dispatcher.tasks.settle(cut.tasks, self.dispatcher.inflight_tasks | self.sink.buffered_tasks)
        self.step += 1  # before the write's await: the dispatcher must never weigh admissions against a stale step
        with writing(f"batch of step {cut.step}", "the trainer never sees a partial batch"):
            await asyncio.to_thread(
                self.writer.write, cut.step, cut.samples, stats, self.source.position, cut.examples, tasks
            )
        if self.journals is not None:  # after the write: until then a crash runs these tasks again
            self.journals.settled(tasks.trained + tasks.spent, self.dispatcher.group_size)
        cancelled = self.dispatcher.cancel_older_than(
            self.step - self.cfg.off_policy_bound, f"too stale for step {self.step}"
        )
        if cancelled:
            log.info(
                "cancelled %d in-flight group(s) dispatched before policy v%d",
                cancelled,
                self.step - self.cfg.off_policy_bound,
            )
        for reason, count in self._failure_reasons.most_common(8):
            log.warning("step %d: %d failed rollout trace(s): %s", cut.step, count, reason)
        self._failure_reasons.clear()
        log.info(
            "step %d: reward %.3f, %d samples (policy v%d, off-policy max %d, failed %d, dropped %d), %.1fs",
            cut.step,
            stats[M.REWARD_MEAN],
            len(cut.samples),
            self.policy.version,
            stats[M.OFF_POLICY_MAX],
            stats[M.ROLLOUTS_FAILED],
            cut.dropped,
            stats[M.GENERATE_S],
        )
