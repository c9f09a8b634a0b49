"""`eval` section: what `primerl eval` and the online evals of `train` evaluate, and how (a section of
the run config, not a group)."""

from dataclasses import dataclass, field

from primerl.config.env import EnvConfig
from primerl.utils.bounds import bounded


@dataclass
class EvalConfig:
    model: str | None = None  # a Hugging Face model directory; or `run` (+ `step`)
    run: str | None = None  # a run directory: evaluates its published policy `step`
    step: int | None = bounded(None, ge=0)  # None: the run's newest stable policy
    num_tasks: int = bounded(128, ge=1)  # the first tasks of the env's stream
    held_out: bool = True  # merge env.eval_args (the env's held-out split, where it has one) over env.args
    samples_per_task: int = bounded(4, ge=1)  # n rollouts per task, for avg@k and pass@k
    k: int = bounded(4, ge=1)  # <= samples_per_task
    temperature: float = bounded(1.0, ge=0)  # 0: greedy
    max_tokens: int | None = bounded(None, ge=1)  # per model call; None: orchestrator.max_tokens
    success_threshold: float = 1.0  # a rollout passes (pass@k) when its reward is at least this
    max_inflight: int = bounded(64, ge=1)  # rollouts at once
    # Online evals during `train` (primerl.orchestrator.online_eval): at the start, every `every` policy versions and
    # at the end, on `envs` (empty: the training env with its `eval_args`, its held-out split). 0: none.
    every: int = bounded(0, ge=0)
    envs: list[EnvConfig] = field(default_factory=list)
