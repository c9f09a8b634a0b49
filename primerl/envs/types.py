"""The rollout types that envs produce and the orchestrator consumes, in one neutral module (no verifiers import).

A rollout is one episode of one task; it yields one `Rollout` per trainable trace (usually one) or a
`RolloutFailure`: failures are data, counted, never exceptions.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class ScoredBranch:
    token_ids: list[int]
    sampled_mask: list[bool]
    logprobs: list[float]
    # on-policy distillation (primerl.orchestrator.teacher): the teacher's log-prob of each token (0.0 where not
    # sampled)
    teacher_logprobs: list[float] | None = None
    # MoE routing replay: the experts the engine routed each token to, [len(token_ids), moe_layers, k] integers (vLLM's
    # `--enable-return-routed-experts`, through verifiers); None: the engine returned none
    routed_experts: np.ndarray | None = None


@dataclass
class Rollout:
    """One finished, scored rollout (one trace) with its trainable branches."""

    reward: float
    rewards: dict[str, float]  # each reward function's score
    branches: list[ScoredBranch]
    completion: str  # the last assistant message
    prompt: str = ""  # the messages before the first assistant message
    metrics: dict[str, float] = field(default_factory=dict)  # the env's @vf.metric values
    transcript: list[dict] = field(default_factory=list)  # primerl.envs.trace_text.transcript: messages with timings


@dataclass
class RolloutFailure:
    reason: str
    # a process of the run failed it, not the env: its env worker was lost (exited or went silent), or the teacher
    # did not score it. Each has its own bound (the worker pool's restart budget, the teacher server's supervisor), so
    # the orchestrator does not count it toward the env's failures
    infrastructure: bool = False


class RolloutRunner(Protocol):
    """Runs one rollout of a task to the end. Failures come back as `RolloutFailure` data, never as exceptions."""

    async def run(self, task: Any, seed: int | None = None) -> list[Rollout | RolloutFailure]:
        """`seed`: the rollout's sampling seed, sent with each of its requests (None: the server's own randomness)."""
        ...
