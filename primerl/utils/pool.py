"""The one policy of primerl's supervised pools: the inference replicas (primerl.orchestrator.replicas, recovered by
the watcher), the env workers (primerl.envs.workers) and the vLLM servers of an inference job
(primerl.entrypoints.inference).

- Pick: a new request goes to the member with the fewest requests outstanding among those taking work; ties go to
  the lowest index (`least_outstanding`; `LeastLoaded` keeps the same pick in O(log n) for pools of hundreds of
  members). Members marked down, starting or lost take nothing.
- Race: a request runs until it answers or its member is lost, whichever comes first; when the member goes first,
  the request is cancelled and the caller learns it at once (`race` returns `LOST`) instead of waiting out a dead
  member's timeouts.
- Health: each member is probed every HEALTH_EVERY_S; its health answers and finished requests are its signs of
  life, and one silent past its limit is lost (primerl.utils.liveness: a loaded member is not a dead one).
- Restarts: a lost member is started again. `RestartBudget` ends the run after `limit` starts in a row that did not
  bring a member back to serving (it died or never answered first): that is a broken config or environment, not a
  fault to ride out. A member that serves again resets the count.
"""

import asyncio
import heapq
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from primerl.utils.errors import RunError

T = TypeVar("T")
HEALTH_EVERY_S = 2.0
LOST = object()  # what `race` returns when the member was lost before the request answered


def least_outstanding(
    outstanding: Sequence[int], taking: Sequence[bool], exclude: set[int] = frozenset()
) -> int | None:
    """The index of the member taking work, not in `exclude`, with the fewest requests outstanding (ties: the lowest
    index); None when there is none."""
    candidates = [i for i, ok in enumerate(taking) if ok and i not in exclude]
    return min(candidates, key=lambda i: (outstanding[i], i)) if candidates else None


class LeastLoaded:
    """Members' outstanding requests and whether each takes work, with `least_outstanding`'s pick in O(log n).

    A heap of (outstanding, index) entries, one pushed at each change; an entry whose count is no longer its
    member's, or whose member takes no work, is stale and dropped when it reaches the top. The heap is rebuilt from
    the members when stale entries outnumber them 3 to 1, so its size stays O(n) and a change costs O(log n)
    amortised. (The linear pick cost ~240 us per rollout at 1,024 replicas, half the orchestrator's whole CPU per
    rollout at 4: benchmarks/control_plane.py.)
    `outstanding` and `taking` are read by others; only `change`, `set_taking` and `pick` write them."""

    def __init__(self, members: int):
        self.outstanding = [0] * members
        self.taking = [True] * members
        self.taking_changes = 0  # counts set_taking calls: what depends on `taking` can cache on it
        self._heap = [(0, index) for index in range(members)]  # sorted: already a heap

    def change(self, index: int, delta: int) -> None:
        self.outstanding[index] += delta
        self._push(index)

    def set_taking(self, index: int, taking: bool) -> None:
        self.taking[index] = taking
        self.taking_changes += 1
        self._push(index)

    def _push(self, index: int) -> None:
        if self.taking[index]:
            heapq.heappush(self._heap, (self.outstanding[index], index))
        if len(self._heap) > 4 * len(self.outstanding) + 64:
            self._heap = [(count, i) for i, count in enumerate(self.outstanding) if self.taking[i]]
            heapq.heapify(self._heap)

    def pick(self, exclude: set[int] = frozenset()) -> int | None:
        """What `least_outstanding(outstanding, taking, exclude)` returns."""
        heap, passed, found = self._heap, [], None
        while heap:
            count, index = heap[0]
            if not self.taking[index] or count != self.outstanding[index]:
                heapq.heappop(heap)
            elif index in exclude:
                passed.append(heapq.heappop(heap))
            else:
                found = index
                break
        for entry in passed:
            heapq.heappush(heap, entry)
        return found


async def race(request: Awaitable[T], lost: Awaitable[Any]) -> T | object:
    """`request`'s result, or `LOST` (the request cancelled) if `lost` completes first. Cancelling the caller cancels
    the request; a `lost` future is never cancelled here (it belongs to the member), a coroutine is."""
    task = asyncio.ensure_future(request)
    member_lost = asyncio.ensure_future(lost) if not isinstance(lost, asyncio.Future) else lost
    try:
        await asyncio.wait((task, member_lost), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller was cancelled (a rollout's timeout): nothing is left running
        task.cancel()
        raise
    finally:
        if member_lost is not lost:
            member_lost.cancel()
    if not task.done():
        task.cancel()  # it finishes cancelling in the background: the caller moves on now
        return LOST
    return task.result()


class RestartBudget:
    """Counts starts in a row that did not bring a member back to serving; `limit` of them raise a RunError."""

    def __init__(self, what: str, limit: int):
        self.what, self.limit, self.failed_in_a_row = what, limit, 0

    def served(self) -> None:
        self.failed_in_a_row = 0

    def failed(self, reason: str) -> None:
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= self.limit:
            raise RunError(f"{self.what} failed to come back {self.failed_in_a_row} times in a row: {reason}")
