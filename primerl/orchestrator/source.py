"""The task stream and the position in it: how many tasks the orchestrator has drawn, and which drawn tasks it owes.

Each task is known by its index in the run's stream (the k-th task drawn since the run began). A restarted
orchestrator goes on from the position stored in its last batch, so no task is drawn twice, and first runs again the
tasks that batch lists as pending (drawn, but neither trained nor spent when it was written: in flight, or finished
and buffered for a later batch), in their order: a kill loses no task, and trains none twice
(primerl.orchestrator.accounting).
"""

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from primerl.utils.log import get_logger

log = get_logger("orchestrator")


class TaskSource:
    def __init__(self, tasks: Iterable[Any], position: int = 0, again: Iterable[int] = ()):
        """`tasks` is read once, in order; `again`: indices below `position` to run again before new tasks."""
        stream: Iterator[Any] = iter(tasks)
        wanted = set(again)
        self._again: collections.deque[tuple[int, Any]] = collections.deque(
            (index, task) for index, task in enumerate(itertools.islice(stream, position)) if index in wanted
        )
        if len(self._again) != len(wanted):
            log.warning(
                "%d pending task(s) are not in the task stream's first %d; not run again",
                len(wanted) - len(self._again),
                position,
            )
        self._tasks = stream
        self.position = position  # tasks drawn from the stream so far (tasks run again do not count)
        self.exhausted = False

    @property
    def owed(self) -> int:
        """Tasks still to run again before new ones."""
        return len(self._again)

    @property
    def owed_tasks(self) -> list[int]:
        """Their indices."""
        return [index for index, _ in self._again]

    def run_first(self, key: Callable[[int], Any]) -> None:
        """Order the tasks still owed by `key` of their index (a stable sort: ties keep the stream's order)."""
        self._again = collections.deque(sorted(self._again, key=lambda owed: key(owed[0])))

    def next(self) -> tuple[int, Any] | None:
        """The next task and its index in the stream, or None once the stream has run out."""
        if self._again:
            return self._again.popleft()
        try:
            task = next(self._tasks)
        except StopIteration:
            self.exhausted = True
            return None
        self.position += 1
        return self.position - 1, task
