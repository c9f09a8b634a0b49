"""What the orchestrator's components hand each other, inside the one orchestrator process.

A *rollout* is one episode of one task (one run of the env); it yields one entry per trainable trace, usually one.
A *group* is `group_size` rollouts of the same task, started together, whose rewards give each other's advantages.
Every dispatched rollout is accounted for exactly once: in a `FinishedGroup` (as ok or failed) or in the
`CancelledGroup` of its group.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

from primerl.envs.verifiers_env import Rollout, RolloutFailure


class RolloutRunner(Protocol):
    """Runs one rollout of a task to the end. Failures come back as `RolloutFailure` data, never as exceptions."""

    async def run(self, task: Any) -> list[Rollout | RolloutFailure]: ...


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
    seconds: list[float] = field(default_factory=list)  # each rollout's wall time, start to finish


@dataclass
class CancelledGroup:
    group_id: int
    version: int
    rollouts: int  # every rollout of the group, finished or not: the group's samples are never trained
    reason: str
