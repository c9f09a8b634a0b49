"""Orchestrator group: batches, sampling, how many rollouts run at once, and the two staleness bounds."""

from dataclasses import dataclass


@dataclass
class OrchestratorConfig:
    batch_size: int = 64  # samples per trainer step
    group_size: int = 8  # rollouts per task, for group-relative advantages
    # How many batches the orchestrator may run ahead of the policy the inference server serves: batch n is cut only
    # once policy n - async_level is loaded. 0 = synchronous: every trained sample comes wholly from the policy it trains.
    async_level: int = 1
    # A sample whose oldest policy version lags the step it would train by more than this is never trained: dropped at
    # the batch cut, or its group cancelled in flight. None: async_level (what async_level alone allows).
    max_off_policy_steps: int | None = None
    max_inflight: int = 128  # rollouts in flight at once, across step boundaries (a multiple of group_size)
    # true: lock-step, as before continuous dispatch: start one batch of groups, wait for every rollout, cut, repeat.
    drain_per_step: bool = False
    max_tokens: int = 64
    temperature: float = 1.0
    rollout_timeout_s: float = 120.0
    weight_poll_s: float = 0.2  # how often the run's weights directory is checked for a newer policy

    @property
    def off_policy_bound(self) -> int:
        return self.async_level if self.max_off_policy_steps is None else self.max_off_policy_steps
