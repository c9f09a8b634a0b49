"""Every task the orchestrator draws is accounted for once: trained, spent or pending.

- trained: samples of it are in a written batch (the first batch that has any lists it in `tasks_trained`);
- spent: it ended without a trained sample (every rollout failed, the filter rejected its group, its samples grew too
  stale, its group was cancelled as too stale), listed in `tasks_spent` of the first batch cut after;
- pending: drawn, not yet either (in flight, or finished and buffered for a later batch). Each batch lists the
  pending tasks at its cut (`tasks_pending`); a restarted orchestrator runs them again before new tasks
  (primerl.orchestrator.source), so a kill loses no drawn task and trains none twice.

Invariant, over a run's batches, kills and restarts included: every task index below the last batch's
`data_position` appears exactly once in some batch's `tasks_trained` or `tasks_spent`, or in the last batch's
`tasks_pending`. A task whose samples were split over two batches counts as trained by the first; after a kill
between the two, its samples still buffered are lost, not run again.
"""

from dataclasses import dataclass, field


@dataclass
class TaskAccount:
    """What one batch records of the tasks (indices in the run's task stream)."""

    trained: list[int] = field(default_factory=list)
    spent: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


@dataclass
class TaskBook:
    open: set[int] = field(default_factory=set)  # drawn, neither trained nor spent

    def drawn(self, index: int) -> None:
        self.open.add(index)

    def settle(self, trained: set[int], alive: set[int]) -> TaskAccount:
        """At a cut: `trained` are the tasks with samples in the batch, `alive` those in flight or still buffered."""
        first = sorted(self.open & trained)
        self.open -= trained
        spent = sorted(self.open - alive)
        self.open &= alive
        return TaskAccount(first, spent, sorted(self.open))
