"""The metrics row of each batch cut (keys: primerl.metrics.OrchestratorMetric).

`batch_stats` describes the cut's own samples and rollouts (a pure function of the cut); `CutMeter` adds what
happened since the previous cut: rollouts finished, failed and cancelled, wall time, time waiting for a policy and
loading weights, event-loop lag, rollout durations, inference idle time, replicas and env workers up.
"""

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from primerl.envs.mixture import env_of
from primerl.metrics import OrchestratorMetric as M
from primerl.orchestrator.gauges import IdleSampler, LoopLag
from primerl.orchestrator.sink import Cut

if TYPE_CHECKING:
    from primerl.envs.workers import EnvWorkers
    from primerl.orchestrator.replicas import Replicas
    from primerl.orchestrator.teacher import TeacherScoring


def batch_stats(cut: Cut, env_names: Sequence[str] = ()) -> dict[str, float]:
    """Reward, off-policy lag and lengths of the cut's samples; per reward function, env and env metric."""
    samples, rollouts = cut.samples, cut.rollouts
    lags = [cut.step - s.policy_version for s in samples]
    spans = [(s.last_policy_version or s.policy_version) - s.policy_version for s in samples]
    stats = {
        M.REWARD_MEAN: statistics.fmean(s.reward for s in samples),
        M.OFF_POLICY_MEAN: statistics.fmean(lags),
        M.OFF_POLICY_MAX: float(max(lags)),
        M.OFF_POLICY_DROPPED: float(cut.dropped),
        M.ROLLOUTS_FILTERED: float(cut.filtered),
        M.VERSION_SPAN_MAX: float(max(spans)),
        M.SEQ_LEN_MEAN: statistics.fmean(len(s.token_ids) for s in samples),
    }
    reward_fns = sorted({name for r in rollouts for name in r.rewards})
    if len(reward_fns) > 1:  # with one reward function reward/<fn> would repeat reward/mean
        for name in reward_fns:
            stats[f"reward/{name}"] = statistics.fmean(r.rewards[name] for r in rollouts if name in r.rewards)
    for name in env_names:
        rewards = [s.reward for s in samples if env_of(s.task_key, [name])]
        stats[f"env/{name}/samples"] = float(len(rewards))
        if rewards:
            stats[f"env/{name}/reward_mean"] = statistics.fmean(rewards)
    scored = [(b.logprobs, b.teacher_logprobs, b.sampled_mask) for r in rollouts for b in r.branches]
    gaps = [s - t for ours, theirs, mask in scored if theirs for s, t, m in zip(ours, theirs, mask) if m]
    if gaps:
        stats[M.TEACHER_KL] = statistics.fmean(gaps)
    for name in sorted({name for r in rollouts for name in r.metrics}):
        stats[f"metric/{name}"] = statistics.fmean(r.metrics[name] for r in rollouts if name in r.metrics)
    return stats


class CutMeter:
    """What changed since the previous cut. The cut loop reports each rollout's wall time (`rollout_seconds`) and
    when a ready cut started to wait for a newer policy (`blocked_since`); `row` reads and resets the rest."""

    def __init__(
        self,
        env_names: Sequence[str] = (),
        idle: IdleSampler | None = None,
        replicas: "Replicas | None" = None,
        env_workers: "Sequence[EnvWorkers]" = (),
        teacher: "TeacherScoring | None" = None,
    ):
        self.env_names = list(env_names)  # a mixture's envs: per-env metrics env/<name>/...
        self.idle, self.replicas, self.env_workers, self.teacher = idle, replicas, env_workers, teacher
        self.loop_lag = LoopLag()  # run by the cut loop
        self.rollout_seconds: list[float] = []
        self.blocked_since: float | None = None
        self._counts = (0, 0, 0)  # rollouts ok, failed, cancelled at the previous cut
        self._last_cut = time.perf_counter()
        self._loads = (0.0, 0.0)  # load_s, fanout_s at the previous cut
        self._rerouted = 0

    def row(
        self, cut: Cut, counts: tuple[int, int, int], loads: tuple[float, float], now_gauges: dict[str, float]
    ) -> dict[str, float]:
        """The cut's metrics row. `counts`: rollouts ok, failed, cancelled so far; `loads`: seconds paused for weight
        loads and seconds of their fan-outs so far; `now_gauges`: values read at the cut (policy version, in flight,
        buffered)."""
        now = time.perf_counter()
        (ok, failed, cancelled), (ok0, failed0, cancelled0), self._counts = counts, self._counts, counts
        batch_s, self._last_cut = now - self._last_cut, now
        waited, self.blocked_since = (now - self.blocked_since if self.blocked_since else 0.0), None
        (loaded, fanned), self._loads = (loads[0] - self._loads[0], loads[1] - self._loads[1]), loads
        lag_max, lag_mean = self.loop_lag.take()
        stats = batch_stats(cut, self.env_names) | now_gauges
        stats |= {
            M.ROLLOUTS_OK: float(ok - ok0),
            M.ROLLOUTS_FAILED: float(failed - failed0),
            M.ROLLOUTS_CANCELLED: float(cancelled - cancelled0),
            M.LOOP_LAG_MAX: lag_max,
            M.LOOP_LAG_MEAN: lag_mean,
            M.GENERATE_S: batch_s,
            M.WAIT_POLICY_S: waited,
            M.WEIGHT_LOAD_S: loaded,
            M.WEIGHT_FANOUT_S: fanned,
            M.TOKENS_PER_S: sum(sum(s.sampled_mask) for s in cut.samples) / max(batch_s, 1e-9),
        }
        return stats | self._since_cut()

    def _since_cut(self) -> dict[str, float]:
        stats = {}
        if self.rollout_seconds:
            seconds, self.rollout_seconds = sorted(self.rollout_seconds), []
            stats[M.ROLLOUT_MEDIAN_S] = statistics.median(seconds)
            stats[M.ROLLOUT_P90_S] = seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))]
            stats[M.ROLLOUT_MAX_S] = seconds[-1]
        if self.teacher is not None:
            stats[M.TEACHER_S] = self.teacher.take_seconds()
        if self.idle is not None and (idle := self.idle.take()) is not None:
            stats[M.INFERENCE_IDLE] = idle
        if self.replicas is not None:
            stats[M.REPLICAS_UP] = float(self.replicas.up_count)
            stats[M.ROLLOUTS_REROUTED] = float(self.replicas.rerouted - self._rerouted)
            self._rerouted = self.replicas.rerouted
        if self.env_workers:
            stats[M.ENV_WORKERS_UP] = float(sum(pool.live_count for pool in self.env_workers))
            stats[M.ENV_WORKER_RESTARTS] = float(sum(pool.restarts for pool in self.env_workers))
        return stats
