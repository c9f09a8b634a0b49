"""Dispatcher: keeps rollouts in flight, across step boundaries, and reports every group exactly once.

`run()` admits one group (group_size rollouts of the next task) whenever there is room for it under
`max_inflight` rollouts and the pacing rule (`may_admit`, the orchestrator's staleness budget) agrees, and otherwise
sleeps until something changes (`wake()`: a group finished, a batch was cut, the policy advanced). Each group records
the policy version it was dispatched under. With a `sampling_seed`, rollout i of the run's k-th task samples with
`request_seed(sampling_seed, k, i)`: the same seeds in every rerun of the run, and after a resume (k counts from the
task stream's start). With `journals`, rollout i of task k keeps its finished turns in its journal
(primerl.orchestrator.episodes), and a task drawn again continues its rollouts from the turns kept there.

Invariants:
- every dispatched rollout is delivered exactly once, by `deliver` called synchronously as its group ends: in the
  group's `FinishedGroup` (ok or failed) or in its `CancelledGroup` (every rollout of a cancelled group counts as
  cancelled, finished or not). Synchronously, so that a finished group is in the sink before the next admission is
  weighed: a group is always either in flight or delivered, never in between;
  `counts.dispatched == ok + failed + cancelled + inflight_rollouts` at every await point;
- a rollout that raises, times out (`rollout_timeout_s`) or returns a failure is a counted failure, never a crash;
- nothing here blocks the event loop: rollouts are tasks, admission is arithmetic.
Cancelling a group cancels its rollouts' tasks; their HTTP requests close, and vLLM aborts a request whose client
went away (`with_cancellation` on its generate route), so the server stops spending time on them.
"""

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from primerl.envs.episode_journal import EPISODE
from primerl.envs.types import Rollout, RolloutFailure, RolloutRunner
from primerl.orchestrator.accounting import TaskBook
from primerl.orchestrator.episodes import EpisodeJournals
from primerl.orchestrator.source import TaskSource
from primerl.orchestrator.types import (
    CancelledGroup,
    FinishedGroup,
    FinishedRollout,
    Policy,
)
from primerl.utils.log import get_logger

log = get_logger(__name__)


def request_seed(sampling_seed: int, task_index: int, sample: int) -> int:
    """The seed of rollout `sample` of the run's `task_index`-th task: distinct within a group, 63 bits (vLLM takes
    an int64)."""
    digest = hashlib.blake2b(f"{sampling_seed}/{task_index}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest) >> 1


@dataclass
class Counts:
    """Rollouts (episodes), cumulative over the orchestrator's life."""

    dispatched: int = 0
    ok: int = 0
    failed: int = 0
    cancelled: int = 0


@dataclass
class _InFlight:
    task: asyncio.Task
    version: int
    rollouts: int
    task_index: int
    cancel_reason: str = ""


class Dispatcher:
    def __init__(
        self,
        source: TaskSource,
        runner: RolloutRunner,
        policy: Policy,
        group_size: int,
        max_inflight: int,
        rollout_timeout_s: float,
        deliver: Callable[[FinishedGroup | CancelledGroup], None],
        may_admit: Callable[[int], bool] = lambda n: True,
        sampling_seed: int | None = None,
        journals: EpisodeJournals | None = None,
        oldest_usable: Callable[[], int] = lambda: 0,
    ):
        """`journals`: where each rollout keeps its finished turns (None: nowhere); `oldest_usable`: the oldest
        policy version a sample may come from now."""
        self.source, self.runner, self.policy = source, runner, policy
        self.group_size, self.max_inflight, self.rollout_timeout_s = group_size, max_inflight, rollout_timeout_s
        self.deliver, self.may_admit, self.sampling_seed = deliver, may_admit, sampling_seed
        self.journals, self.oldest_usable = journals, oldest_usable
        self.counts = Counts()
        self.tasks = TaskBook()  # which drawn tasks are trained, spent or pending (primerl.orchestrator.accounting)
        self.groups: dict[int, _InFlight] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._stopped = False

    @property
    def inflight_rollouts(self) -> int:
        return sum(g.rollouts for g in self.groups.values())

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Admit groups until `stop()` (or the task stream runs out)."""
        while not self._stopped:
            while (
                not self._stopped
                and self.inflight_rollouts + self.group_size <= self.max_inflight
                and self.may_admit(self.group_size)
            ):
                drawn = self.source.next()
                if drawn is None:
                    log.warning("the task stream ran out after %d tasks; no more rollouts", self.source.position)
                    return
                self._admit(*drawn)
            await self._wake.wait()
            self._wake.clear()

    def _admit(self, index: int, task: Any) -> None:
        group_id, version = next(self._ids), self.policy.version
        if self.journals is not None and (kept := self.journals.kept_turns(index, self.oldest_usable())) is not None:
            version = min(version, kept)  # the group's version is the oldest that sampled any of its tokens
        self.counts.dispatched += self.group_size
        self.tasks.drawn(index)
        seeds = [None] * self.group_size
        if self.sampling_seed is not None:
            seeds = [request_seed(self.sampling_seed, index, i) for i in range(self.group_size)]
        run = asyncio.create_task(self._run_group(group_id, index, task, version, seeds), name=f"group-{group_id}")
        self.groups[group_id] = _InFlight(run, version, self.group_size, index)

    @property
    def inflight_tasks(self) -> set[int]:
        return {g.task_index for g in self.groups.values()}

    async def _run_group(self, group_id: int, index: int, task: Any, version: int, seeds: list[int | None]) -> None:
        try:
            per_rollout = await asyncio.gather(
                *(self._run_rollout(task, seed, self._journal(index, sample)) for sample, seed in enumerate(seeds))
            )
        except asyncio.CancelledError:
            reason = self.groups[group_id].cancel_reason or "orchestrator stopping"
            self.groups.pop(group_id)
            self.counts.cancelled += self.group_size
            self._emit(CancelledGroup(group_id, version, self.group_size, reason))
            return  # the cancellation is reported, not propagated: this task is ours alone
        self.groups.pop(group_id)
        group = FinishedGroup(group_id, str(getattr(task, "key", group_id)), version, task_index=index)
        for entries, last_version, seconds in per_rollout:
            group.seconds.append(seconds)
            usable = [e for e in entries if isinstance(e, Rollout)]
            group.rollouts += [FinishedRollout(r, last_version) for r in usable]
            group.failures += [e.reason for e in entries if isinstance(e, RolloutFailure)]
            if usable:
                group.ok_rollouts += 1
            else:
                group.failed_rollouts += 1
                group.lost_rollouts += all(e.infrastructure for e in entries)  # no usable trace: all are failures
        self.counts.ok += group.ok_rollouts
        self.counts.failed += group.failed_rollouts
        self._emit(group)

    def _journal(self, index: int, sample: int) -> str | None:
        return None if self.journals is None else str(self.journals.path(index, sample))

    async def _run_rollout(
        self, task: Any, seed: int | None, journal: str | None
    ) -> tuple[list[Rollout | RolloutFailure], int, float]:
        started = time.perf_counter()
        EPISODE.set(journal)  # this rollout's own task (gather wrapped it): its context is its own
        try:
            async with asyncio.timeout(self.rollout_timeout_s):  # in this task: wait_for would start one per rollout
                entries = await self.runner.run(task, seed)
        except TimeoutError:
            entries = [RolloutFailure(f"rollout exceeded orchestrator.rollout_timeout_s={self.rollout_timeout_s:g}")]
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a runner bug costs its rollout, not the run
            entries = [RolloutFailure(f"rollout raised {type(err).__name__}: {str(err)[:300]}")]
        if not entries:
            entries = [RolloutFailure("the episode produced no trace")]
        return entries, self.policy.version, time.perf_counter() - started

    def _emit(self, item: FinishedGroup | CancelledGroup) -> None:
        self._wake.set()
        self.deliver(item)

    def cancel_older_than(self, version: int, reason: str) -> int:
        """Cancel every in-flight group dispatched under a policy older than `version`; returns how many groups."""
        stale = [g for g in self.groups.values() if g.version < version and not g.cancel_reason]
        for group in stale:
            group.cancel_reason = reason
            group.task.cancel()
        return len(stale)

    async def stop(self, reason: str = "orchestrator stopping") -> None:
        """Stop admitting, cancel every in-flight group (each still delivers its `CancelledGroup`), wait for them."""
        self._stopped = True
        self._wake.set()
        running = [g.task for g in self.groups.values()]
        for group in list(self.groups.values()):
            group.cancel_reason = group.cancel_reason or reason
            group.task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
