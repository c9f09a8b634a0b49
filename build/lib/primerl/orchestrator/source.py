"""The task stream and the position in it: how many tasks the orchestrator has drawn.

A restarted orchestrator skips the tasks its predecessor drew (the position stored in its last batch), so no task is
drawn twice in a run. Tasks drawn for rollouts that were in flight or buffered at a kill are not drawn again: a kill
loses those rollouts, never duplicates them.
"""

import itertools
from collections.abc import Iterable, Iterator
from typing import Any


class TaskSource:
    def __init__(self, tasks: Iterable[Any], position: int = 0):
        self._tasks: Iterator[Any] = itertools.islice(iter(tasks), position, None)
        self.position = position  # tasks drawn so far
        self.exhausted = False

    def next(self) -> Any | None:
        """The next task, or None once the stream has run out."""
        try:
            task = next(self._tasks)
        except StopIteration:
            self.exhausted = True
            return None
        self.position += 1
        return task
