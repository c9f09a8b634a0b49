"""What the orchestrator's components hand each other, inside the one orchestrator process.

A *rollout* is one episode of one task (one run of the env); it yields one entry per trainable trace, usually one.
A *group* is `group_size` rollouts of the same task, started together, whose rewards give each other's advantages.
Every dispatched rollout is accounted for exactly once: in a `FinishedGroup` (as ok or failed) or in the
`CancelledGroup` of its group.
"""

from dataclasses import dataclass, field
from typing import Protocol

from primerl.envs.types import Rollout


@dataclass
class Policy:
    """The policy version the inference server serves: advanced by the watcher once a load has finished."""

    version: int = 0


@dataclass
class FinishedRollout:
    rollout: Rollout
    last_version: int  # the served policy version when it finished (it may have started under an older one)


@dataclass
class FinishedGroup:
    group_id: int
    task_key: str
    version: int  # the policy version when the group was dispatched: the oldest that generated any of its tokens
    rollouts: list[FinishedRollout] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # one reason per failed trace
    ok_rollouts: int = 0  # rollouts (episodes) with at least one usable trace
    failed_rollouts: int = 0  # rollouts with none
    lost_rollouts: int = (
        0  # of those, rollouts whose failures all came from the run's processes (RolloutFailure.infrastructure)
    )
    seconds: list[float] = field(default_factory=list)  # each rollout's wall time, start to finish
    task_index: int = -1  # the task's index in the run's task stream (primerl.orchestrator.source)


@dataclass
class CancelledGroup:
    group_id: int
    version: int
    rollouts: int  # every rollout of the group, finished or not: the group's samples are never trained
    reason: str


class Servers(Protocol):
    """The inference servers rollouts go to, as the cut loop sees them (primerl.orchestrator.watcher.Watcher)."""

    @property
    def serving(self) -> bool:
        """Whether any replica takes rollouts now: while none does, failed rollouts say nothing about the env."""

    @property
    def recoveries(self) -> int:
        """Replicas brought back so far: a recovery resets the count of rollouts failed in a row."""

    @property
    def load_s(self) -> float:
        """Seconds the replicas were paused for weight loads so far (the slowest replica's, per load)."""

    @property
    def fanout_s(self) -> float:
        """Seconds from each new version's first load request to every replica serving it, so far."""

    def check_health(self) -> None:
        """A whole group failed: look at the servers now rather than at the next health check."""


class AlwaysServing:
    """`Servers` for a cut loop without a watcher (tests, benchmarks): always up, never loading."""

    serving, recoveries, load_s, fanout_s = True, 0, 0.0, 0.0

    def check_health(self) -> None:
        pass
