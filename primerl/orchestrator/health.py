"""Health checks of the inference replicas, spread over time: each up replica is probed about once per HEALTH_EVERY_S,
a slice of them at each of the watcher's ticks, and not at all while it shows life otherwise.

Why: probing every replica at once each HEALTH_EVERY_S cost the orchestrator ~1.3 ms of CPU per replica in a burst
(1.3 s every 2 s at 1,024 replicas, benchmarks/control_plane.py) that stalled dispatch. Now:

- a round visits the replicas in index order, `R * elapsed / HEALTH_EVERY_S` of them per tick, so every replica is
  visited once per HEALTH_EVERY_S (plus a tick) and the requests per second are even;
- a visited replica that finished a rollout, answered a weight load (pause, load, proof, resume:
  primerl.orchestrator.watcher) or answered a probe within HEALTH_EVERY_S is not probed: a rollout that finished is a
  better sign of life than /health, and one that failed on a replica that refuses /health marks it down at once
  (primerl.orchestrator.replicas). With a version every few seconds, which is when the replicas are many and the
  probes would cost the most, every loaded replica shows life at each version;
- a probe that gets no answer adds the silence since that replica's last probe (primerl.utils.liveness); a refused
  one marks it down at once.
So a dead replica with no rollouts is out within HEALTH_EVERY_S plus a tick; one with rollouts, when they fail.
`probe()` without indices checks every up replica now (after a group whose rollouts all failed, or a failed load).
"""

import asyncio
import time

from primerl.orchestrator.replicas import Replicas
from primerl.utils.pool import HEALTH_EVERY_S


class Health:
    def __init__(self, replicas: Replicas, every_s: float = HEALTH_EVERY_S):
        self.replicas, self.every_s = replicas, every_s
        now = time.monotonic()
        self._probed_at = [now] * len(replicas)  # each replica's last probe (its silence is counted from there)
        self._cursor, self._owed, self._ticked_at = 0, 0.0, now

    def due(self) -> list[int]:
        """The up replicas this tick's slice of the round visits that showed no life within `every_s`."""
        replicas, now = self.replicas, time.monotonic()
        count = len(replicas)
        self._owed = min(count, self._owed + count * (now - self._ticked_at) / self.every_s)
        self._ticked_at = now
        visits = int(self._owed)
        self._owed -= visits
        due = []
        for _ in range(visits):
            index, self._cursor = self._cursor, (self._cursor + 1) % count
            if replicas.up[index] and now - replicas.pulses[index].seen_at >= self.every_s:
                due.append(index)
        return due

    async def probe(self, indices: list[int] | None = None) -> None:
        """Probe `indices` (None: every up replica); mark down each that refuses /health or has been silent past the
        liveness limit."""
        replicas = self.replicas
        if indices is None:
            indices = [index for index in range(len(replicas)) if replicas.up[index]]
        if not indices:
            return
        answers = await asyncio.gather(*(replicas.clients[index].health() for index in indices))
        now = time.monotonic()
        for index, answer in zip(indices, answers, strict=True):
            pulse, elapsed = replicas.pulses[index], now - self._probed_at[index]
            self._probed_at[index] = now
            if not replicas.up[index]:
                continue  # marked down meanwhile (a rollout's failure)
            if answer:
                pulse.answered()
            elif answer is False:
                replicas.mark_down(index, "/health refused")
            elif replicas.liveness.observe(pulse, elapsed):
                limit = replicas.liveness.limit(pulse)
                replicas.mark_down(index, f"no /health answer and no rollout finished in {limit:.0f}s")
