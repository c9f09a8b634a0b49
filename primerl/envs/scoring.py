"""Evaluation rollouts and their scores: mean with its standard error, avg@k, unbiased pass@k (Chen et al., 2021).

Shared by `primerl eval` and the orchestrator's online evals (primerl.orchestrator.online_eval).
"""

import asyncio
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k rollouts drawn without replacement from n, c of which passed, passes:
    1 - C(n-c, k) / C(n, k), unbiased for the policy's pass@k when the n rollouts are independent samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class TaskResult:
    """One task's rollouts: the finished ones' rewards (in the order they finished), reward-function scores and env
    metrics, and a reason per failed one."""

    rewards: list[float] = field(default_factory=list)
    scores: list[dict[str, float]] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, reward: float, scores: dict[str, float], metrics: dict[str, float]) -> None:
        self.rewards.append(reward)
        self.scores.append(scores)
        self.metrics.append(metrics)


def _means(rows: list[dict[str, float]], prefix: str) -> dict[str, float]:
    names = sorted({name for row in rows for name in row})
    return {f"{prefix}{n}": statistics.fmean(row[n] for row in rows if n in row) for n in names}


def summarize(tasks: list[TaskResult], k: int, threshold: float) -> dict[str, float]:
    """mean reward and its standard error over every finished rollout; avg@k, the mean over tasks of the mean of
    their first k rollouts; pass@k over the tasks whose rollouts all finished (a failure is not a sample of the
    policy's answer); each reward function's (`reward/<fn>`) and env metric's (`metric/<name>`) mean. Failed
    rollouts are counted, never scored as 0."""
    rewards = [r for t in tasks for r in t.rewards]
    out: dict[str, float] = {
        "tasks": float(len(tasks)),
        "rollouts": float(len(rewards)),
        "failures": float(sum(len(t.failures) for t in tasks)),
    }
    if not rewards:
        return out
    out["reward_mean"] = statistics.fmean(rewards)
    out["reward_stderr"] = statistics.stdev(rewards) / math.sqrt(len(rewards)) if len(rewards) > 1 else 0.0
    with_k = [t for t in tasks if len(t.rewards) >= k]
    if with_k:
        out[f"avg@{k}"] = statistics.fmean(statistics.fmean(t.rewards[:k]) for t in with_k)
    complete = [t for t in tasks if not t.failures and len(t.rewards) >= k]
    if complete:
        out[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(t.rewards), sum(r >= threshold for r in t.rewards), k) for t in complete
        )
    out |= _means([s for t in tasks for s in t.scores], "reward/")
    out |= _means([m for t in tasks for m in t.metrics], "metric/")
    return out


async def run_tasks(
    runner: Any,
    tasks: list,
    samples_per_task: int,
    max_inflight: int,
    timeout_s: float,
    on_rollout: Callable[[], None] = lambda: None,
) -> list[TaskResult]:
    """`samples_per_task` rollouts of each task through `runner` (an EnvRunner), at most `max_inflight` at once.
    A rollout that raises, times out or fails is a reason in its task's `failures`, never an exception."""
    from primerl.envs.types import Rollout

    results = [TaskResult() for _ in tasks]
    slots = asyncio.Semaphore(max_inflight)

    async def one(index: int, task: Any) -> None:
        async with slots:
            try:
                entries = await asyncio.wait_for(runner.run(task), timeout_s)
            except TimeoutError:
                entries = []
                results[index].failures.append(f"timeout after {timeout_s:.0f}s")
            except Exception as err:  # noqa: BLE001 - a rollout's failure is data, never the evaluation's end
                entries = []
                results[index].failures.append(f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        first = entries[0] if entries else None  # one trainable trace per rollout in single-agent envs
        if isinstance(first, Rollout):
            results[index].add(first.reward, first.rewards, first.metrics)
        elif first is not None:
            results[index].failures.append(first.reason)
        on_rollout()

    await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks) for _ in range(samples_per_task)))
    return results
