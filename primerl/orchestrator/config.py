"""Orchestrator group: rollout batching, sampling and off-policy bounds."""

from dataclasses import dataclass


@dataclass
class OrchestratorConfig:
    batch_size: int = 64  # samples (rollouts) per trainer step
    group_size: int = 8  # rollouts per task, for group-relative advantages
    async_level: int = 1  # max policy versions a trained sample may lag; 0 = synchronous
    max_tokens: int = 64
    temperature: float = 1.0
    rollout_timeout_s: float = 120.0
