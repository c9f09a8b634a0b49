"""Background samplers for the orchestrator's health metrics, read and reset at every batch cut.

- `LoopLag`: how late a 50 ms timer fires on the orchestrator's event loop. Anything that blocks the loop (synchronous
  I/O, a long computation) shows here as lag, and delays every rollout at once.
- `IdleSampler`: polls one inference replica's `num_requests_running` (vLLM's /metrics) every `period_s`, the
  replicas in turn; the idle fraction is the share of polls that found no running request: of the replicas' time,
  the share they had nothing to run. At 4 polls/s the cost is one small HTTP request each, however many replicas.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable


class LoopLag:
    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags.append(max(0.0, time.perf_counter() - started - self.period_s))

    def take(self) -> tuple[float, float]:
        """(max, mean) lag in seconds since the previous take."""
        lags, self.lags = self.lags, []
        return (max(lags), sum(lags) / len(lags)) if lags else (0.0, 0.0)


class IdleSampler:
    def __init__(self, running: Callable[[], Awaitable[float | None]], period_s: float = 0.25):
        self.running, self.period_s = running, period_s
        self.idle = self.polls = 0

    async def run(self) -> None:
        while True:
            value = await self.running()
            if value is not None:
                self.polls += 1
                self.idle += value == 0
            await asyncio.sleep(self.period_s)

    def take(self) -> float | None:
        """The idle fraction since the previous take (None without a reading)."""
        fraction = self.idle / self.polls if self.polls else None
        self.idle = self.polls = 0
        return fraction
