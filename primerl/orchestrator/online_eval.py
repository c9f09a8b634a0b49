"""Online evals: the policy being trained, scored on held-out envs while training goes on.

At policy version 0, at the first version served at or past each multiple of `eval.every`, and at `max_steps`, each
eval env's first `eval.num_tasks` tasks get `eval.samples_per_task` rollouts at `eval.temperature` on the shared
inference server, at most `eval.max_inflight` at once, beside the training rollouts. One row per eval goes to
`metrics/eval.jsonl` (`<env id>/reward_mean`, `.../pass_at_k`, ..., step = the policy version), so the ledger gets
`eval/<env id>/...` by step.

Invariants:
- every rollout of the eval at version v runs on policy v: the watcher awaits `before_load(v)` before it loads a
  newer policy (the trainer may meanwhile run ahead by async_level batches, no further);
- eval rollouts never enter a batch and are never cancelled as stale: they run outside the dispatcher;
- a version already in `metrics/eval.jsonl` (a resumed orchestrator) is not evaluated again.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primerl.config.eval import EvalConfig
from primerl.envs.scoring import run_tasks, summarize
from primerl.metrics import EVAL, append_metrics, read_metrics
from primerl.orchestrator.types import Policy
from primerl.utils.log import get_logger
from primerl.utils.wait import wait_until_async

log = get_logger(__name__)


@dataclass
class EvalSuite:
    name: str  # the env id, made unique
    runner: Any  # an EnvRunner
    tasks: list


class OnlineEval:
    def __init__(self, suites: list[EvalSuite], cfg: EvalConfig, max_steps: int, run_dir: Path, timeout_s: float):
        self.suites, self.cfg, self.max_steps, self.run_dir, self.timeout_s = suites, cfg, max_steps, run_dir, timeout_s
        self.done = {int(row["step"]) for row in read_metrics(run_dir, EVAL)}
        last = max(self.done, default=-1)
        self.next_mark = (last // cfg.every + 1) * cfg.every if last >= 0 else cfg.every

    def due(self, version: int) -> bool:
        if version in self.done:
            return False
        return version in (0, self.max_steps) or version >= self.next_mark

    async def before_load(self, version: int) -> None:
        """The watcher's hook: evaluate the policy it serves now, if due, before it loads a newer one."""
        if self.due(version):
            await self.run(version)

    async def finish(self, policy: Policy) -> None:
        """After the last batch: wait until the final policy is served, then evaluate it."""
        await wait_until_async(
            lambda: policy.version >= self.max_steps, f"policy v{self.max_steps} to be served", note_every_s=60
        )
        await self.before_load(self.max_steps)

    async def run(self, version: int) -> None:
        row: dict[str, float] = {}
        for suite in self.suites:
            started = time.perf_counter()
            results = await run_tasks(
                suite.runner, suite.tasks, self.cfg.samples_per_task, self.cfg.max_inflight, self.timeout_s
            )
            scores = summarize(results, self.cfg.k, self.cfg.success_threshold)
            scores["wall_s"] = time.perf_counter() - started
            row |= {f"{suite.name}/{key.replace('@', '_at_')}": value for key, value in scores.items()}
            log.info(
                "eval of policy v%d on %s: reward %.3f over %d rollouts (%d failed) in %.1fs",
                version,
                suite.name,
                scores.get("reward_mean", float("nan")),
                scores["rollouts"],
                scores["failures"],
                scores["wall_s"],
            )
        append_metrics(self.run_dir, EVAL, version, row)
        self.done.add(version)
        while self.next_mark <= version:
            self.next_mark += self.cfg.every
