"""Sink: finished groups -> advantages -> a buffer of samples -> batches of exactly `batch_size` samples.

Pure bookkeeping, no I/O, no awaits. A group's advantages come from its own usable rollouts (same task, dispatched
under one policy version), scaled by `reward_weight`; a branch the teacher scored adds `distill_coef x (teacher -
student log-prob)` on each sampled token (on-policy distillation: the reverse KL's per-token estimate, with the
inference log-probs as the student's); each trainable branch of a rollout becomes one `Sample` carrying its group's
dispatch version (the oldest policy that generated any of its tokens), the version served when it finished, and the
experts the engine routed its tokens to, when it returned them (MoE routing replay).

Invariants:
- `cut(step)` first drops every buffered sample whose oldest version lags `step` by more than `max_off_policy_steps`,
  so no emitted sample lags more than the bound; then, if at least `batch_size` samples remain, it emits
  `batch_size` of them, oldest policy version first and in arrival order within a version (a sample that the next
  batch could no longer take goes first); the leftovers stay for the next batch;
- `cut_all(step)` (lock-step mode) emits whatever is buffered, after the same drop;
- every sample added is either emitted once or counted as dropped once; a group the filter rejects
  (`orchestrator.filter`) is never buffered, and its rollouts are counted with the next cut.
"""

from dataclasses import dataclass, field

from primerl.config.orchestrator import FilterConfig
from primerl.envs.types import Rollout, ScoredBranch
from primerl.orchestrator.advantages import group_advantages
from primerl.orchestrator.types import FinishedGroup
from primerl.transport.batches import Sample


@dataclass
class Cut:
    step: int
    samples: list[Sample]
    dropped: int  # samples dropped as too stale since the previous cut
    rollouts: list[Rollout] = field(default_factory=list)  # whose first branch is in this batch (per-rollout stats)
    examples: list[dict] = field(default_factory=list)  # a few of them, for people
    filtered: int = 0  # rollouts of groups the filter rejected since the previous cut
    tasks: set[int] = field(default_factory=set)  # the tasks (stream indices) whose samples are in this batch


@dataclass
class _Buffered:
    sample: Sample
    order: tuple[int, int, int]  # (group id: dispatch order, rollout, branch): the batch's packing order
    rollout: Rollout | None = None  # set on a rollout's first branch only
    example: dict | None = None
    task: int = -1  # the group's task index in the run's stream


class Sink:
    def __init__(
        self,
        batch_size: int,
        max_off_policy_steps: int,
        examples_per_batch: int = 4,
        advantage: str = "mean",
        group_filter: FilterConfig | None = None,
        reward_weight: float = 1.0,
        distill_coef: float = 1.0,
    ):
        """`reward_weight` scales the reward advantages; `distill_coef` the per-token reverse KL of a branch the
        teacher scored, `teacher - student` log-prob of each sampled token (primerl.orchestrator.teacher)."""
        self.batch_size, self.max_off_policy_steps = batch_size, max_off_policy_steps
        self.examples_per_batch, self.advantage = examples_per_batch, advantage
        self.reward_weight, self.distill_coef = reward_weight, distill_coef
        self.group_filter = group_filter or FilterConfig()
        self.buffer: list[_Buffered] = []
        self.pending_dropped = 0  # dropped since the last emitted batch: reported with the next one
        self.pending_filtered = 0  # rollouts of groups the filter rejected since the last emitted batch

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    @property
    def buffered_tasks(self) -> set[int]:
        return {entry.task for entry in self.buffer}

    def add(self, group: FinishedGroup) -> None:
        """Buffer the group's samples with their advantages, unless the filter rejects the group (counted)."""
        rewards = [f.rollout.reward for f in group.rollouts]
        if not self.group_filter.keeps(rewards):
            self.pending_filtered += len(rewards)
            return
        advantages = group_advantages(rewards, self.advantage)
        for r, (finished, advantage) in enumerate(zip(group.rollouts, advantages, strict=True)):
            rollout = finished.rollout
            example = {
                "task": group.task_key,
                "prompt": rollout.prompt[:500],
                "completion": rollout.completion[:500],
                "reward": rollout.reward,
                "rewards": rollout.rewards,
                "metrics": rollout.metrics,
                "policy_versions": [group.version, finished.last_version],
                "messages": rollout.transcript,
            }
            for i, branch in enumerate(rollout.branches):
                sample = Sample(
                    branch.token_ids,
                    branch.sampled_mask,
                    branch.logprobs,
                    rollout.reward,
                    self.reward_weight * advantage,
                    group.version,
                    group.task_key,
                    finished.last_version,
                    self._distilled(branch),
                    branch.routed_experts,
                )
                order, task = (group.group_id, r, i), group.task_index
                first = i == 0
                self.buffer.append(
                    _Buffered(sample, order, rollout if first else None, example if first else None, task)
                )

    def drop_stale(self, step: int) -> int:
        oldest = step - self.max_off_policy_steps
        kept = [entry for entry in self.buffer if entry.sample.policy_version >= oldest]
        dropped = len(self.buffer) - len(kept)
        self.buffer = kept
        return dropped

    def _distilled(self, branch: ScoredBranch) -> list[float] | None:
        """The per-token reverse-KL advantage of a branch the teacher scored, None for one it did not."""
        if branch.teacher_logprobs is None:
            return None
        return [
            self.distill_coef * (teacher - student) if sampled else 0.0
            for teacher, student, sampled in zip(branch.teacher_logprobs, branch.logprobs, branch.sampled_mask)
        ]

    def cut(self, step: int) -> Cut | None:
        """Batch `step`, if `batch_size` fresh-enough samples are buffered; else None (stale ones are dropped
        either way and reported with the next batch)."""
        self.pending_dropped += self.drop_stale(step)
        if len(self.buffer) < self.batch_size:
            return None
        return self._emit(step, self.batch_size)

    def cut_all(self, step: int) -> Cut | None:
        self.pending_dropped += self.drop_stale(step)
        return self._emit(step, len(self.buffer)) if self.buffer else None

    def _emit(self, step: int, n: int) -> Cut:
        # oldest policy first (stable): a sample that would be too stale for the next batch is used while it still may
        self.buffer.sort(key=lambda entry: entry.sample.policy_version)
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        # packed in dispatch order, not finish order: the same samples make the same batch, to the bit
        taken.sort(key=lambda entry: entry.order)
        examples = self._examples(step, taken)
        rollouts = [t.rollout for t in taken if t.rollout is not None]
        cut = Cut(step, [t.sample for t in taken], self.pending_dropped, rollouts, examples, self.pending_filtered)
        cut.tasks = {t.task for t in taken}
        self.pending_dropped = self.pending_filtered = 0
        return cut

    def _examples(self, step: int, taken: list["_Buffered"]) -> list[dict]:
        """A few rollouts of the batch for people: one per task (its group), in batch order, so a batch of several
        groups or of a mixture's envs shows each rather than one group's rollouts of the same task."""
        examples: dict[str, dict] = {}
        for entry in taken:
            if entry.example is not None and len(examples) < self.examples_per_batch:
                examples.setdefault(entry.example["task"], {"step": step, **entry.example})
        return list(examples.values())
