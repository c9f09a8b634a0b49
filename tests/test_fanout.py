"""The control plane's fan-out and health rounds at many replicas: a bound on the loads in flight, a slow replica's
load cut once the others are done, and health probes spread over time and skipped for replicas that show life."""

import asyncio
import math
import time

from primerl.orchestrator import fanout
from primerl.orchestrator.fanout import Straggler, fan_out
from primerl.orchestrator.health import Health
from primerl.orchestrator.replicas import Replicas


def test_loads_run_at_most_the_bound_at_once_and_a_straggler_is_cut_once_half_are_done(monkeypatch):
    monkeypatch.setattr(fanout, "STRAGGLER_MIN_S", 0.3)
    monkeypatch.setattr(fanout, "CHECK_EVERY_S", 0.02)
    running, most = 0, 0

    async def load(index: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await asyncio.sleep(5.0 if index == 7 else 0.02)
            if index == 3:
                raise RuntimeError("refused")
            return index
        finally:
            running -= 1

    async def main():
        started = time.monotonic()
        results = await fan_out(list(range(12)), load, at_once=4)
        return results, time.monotonic() - started

    results, seconds = asyncio.run(main())
    assert most == 4 and sorted(results) == list(range(12))
    assert all(results[i] == i for i in range(12) if i not in (3, 7))
    assert isinstance(results[3], RuntimeError) and isinstance(results[7], Straggler)
    assert 0.3 < seconds < 1.5  # cut at the minimum, not after its 5 s
    # unbounded (a collective offer): all in flight at once
    most = 0
    asyncio.run(fan_out(list(range(6)), load, at_once=None))
    assert most == 6


class Silent:
    """A replica's client whose /health answers nothing in time."""

    def __init__(self):
        self.probes = 0

    async def health(self) -> None:
        self.probes += 1


def test_health_probes_are_spread_over_the_round_and_skip_replicas_that_show_life():
    """Each idle replica is probed about once per round, a slice per tick, never all in one tick; a replica that
    keeps finishing rollouts is never probed."""
    clients = [Silent() for _ in range(8)]
    replicas = Replicas(clients)
    every_s, tick_s = 0.4, 0.05
    health = Health(replicas, every_s)
    slices: list[list[int]] = []

    async def main():
        started = time.monotonic()
        while time.monotonic() - started < 3 * every_s:
            for busy in range(4):  # replicas 0-3 finish rollouts all along
                replicas.liveness.finished(replicas.pulses[busy])
            due = health.due()
            slices.append(due)
            await health.probe(due)
            await asyncio.sleep(tick_s)

    asyncio.run(main())
    assert all(client.probes == 0 for client in clients[:4])
    assert all(1 <= client.probes <= 3 for client in clients[4:]), [c.probes for c in clients]
    assert max(len(due) for due in slices) <= math.ceil(8 * 2 * tick_s / every_s) + 1
    assert replicas.up == [True] * 8  # a few seconds of silence are within the liveness limit
