"""One weight load fanned out to many replicas: a bound on the loads in flight, and a deadline for each replica set by
the others' loads.

- **Bounded**: at most FILE_LOADS_AT_ONCE file loads are in flight; each holds a connection (the orchestrator raises
  its open-files limit at start: primerl.utils.process.raise_open_files_limit). The bound is high on purpose: a load
  in flight costs the orchestrator nothing while the server reads its weights, and waves would multiply a version's
  time by their number (benchmarks/control_plane.py `--load-s`). Collective offers are not bounded at all: the
  trainer sends to each replica's group in its own order, and a receiver held back here would stall it. Loads start
  STARTS_PER_TURN per turn of the event loop, so a fan-out to 1,024 replicas does not hold the loop in one long turn.
- **Stragglers**: once half the replicas finished, a load that has run STRAGGLER_FACTOR times the median finished
  load (and at least STRAGGLER_MIN_S) is cut on this side and reported as a `Straggler`: one slow replica does not
  hold the version back from the others. The watcher takes it out of routing; its server finishes the load on its
  own, and the replica's recovery makes it serve the version and resumes it (primerl.orchestrator.recovery).
"""

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
FILE_LOADS_AT_ONCE = 1024
STRAGGLER_FACTOR = 3.0
STRAGGLER_MIN_S = 10.0
CHECK_EVERY_S = 0.5
STARTS_PER_TURN = 64  # loads started per turn of the event loop


class Straggler(RuntimeError):
    """A replica's load cut because it ran far longer than the others'."""


async def fan_out(
    targets: list[int], load: Callable[[int], Awaitable[T]], at_once: int | None
) -> dict[int, T | BaseException]:
    """`load(i)` for every target, at most `at_once` in flight (None: all); each target's result or exception."""
    gate = asyncio.Semaphore(at_once or max(len(targets), 1))
    started: dict[int, float] = {}
    seconds: list[float] = []

    async def one(index: int) -> T:
        async with gate:
            started[index] = time.monotonic()
            try:
                result = await load(index)
            except Exception:
                seconds.append(time.monotonic() - started[index])
                raise
            seconds.append(time.monotonic() - started[index])  # a load cut short is not counted
            return result

    tasks: dict[asyncio.Future, int] = {}
    for index in targets:
        tasks[asyncio.ensure_future(one(index))] = index
        if len(tasks) % STARTS_PER_TURN == 0:
            await asyncio.sleep(0)  # let the loop turn: dispatch goes on between slices of a long fan-out
    results: dict[int, T | BaseException] = {}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=CHECK_EVERY_S)
            for task in done:
                results[tasks[task]] = task.exception() or task.result()
            if 2 * len(results) >= len(targets) and seconds:
                for task in _cut(pending, tasks, started, statistics.median(seconds), results):
                    pending.discard(task)
    finally:
        for task in pending:
            task.cancel()
    return results


def _cut(
    pending: set[asyncio.Future],
    tasks: dict[asyncio.Future, int],
    started: dict[int, float],
    median_s: float,
    results: dict,
) -> list[asyncio.Future]:
    """Cancel the pending loads past the straggler limit; their results become `Straggler`s."""
    limit, now, cut = max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * median_s), time.monotonic(), []
    for task in pending:
        index = tasks[task]
        if index in started and now - started[index] > limit:
            task.cancel()
            results[index] = Straggler(
                f"still loading after {now - started[index]:.1f}s while the median replica took {median_s:.1f}s"
            )
            cut.append(task)
    return cut
