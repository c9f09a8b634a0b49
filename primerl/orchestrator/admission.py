"""Admission by the engines' own pressure (`orchestrator.admission=kv_pressure`): how many rollouts may be in flight.

A fixed `orchestrator.max_inflight` is either too low (the engines idle between requests) or too high (vLLM runs out
of KV cache, preempts running requests and computes their prefixes again), and the right value moves as completions
grow during training. Here each replica i has a limit L_i on its outstanding rollouts, adjusted from its own
`/metrics` (read one replica per tick, in turn, as the idle gauge does):

- pressure, L_i = max(floor, floor(L_i x 3/4)): the replica preempted a request since its last reading
  (`vllm:num_preemptions_total` grew), or requests wait while its KV cache is at least 95% used;
- room, L_i = min(cap, L_i + step): no preemption, nothing waiting, KV cache under 85% used, and the replica uses
  its limit (outstanding >= L_i - step): there is memory for more, and more is wanted;
- otherwise L_i stays;
- one decrease a wave: after a decrease, the replica's readings change nothing until its outstanding rollouts have
  fallen to the new limit. The rollouts admitted under the old limit keep growing their contexts and preempt after
  the decrease; counting their preemptions against the new limit cut it again and again (to 9-24 rollouts, against
  the 48 that ran best: benchmarks/results.md), as TCP's congestion control halves its window once per round trip,
  not once per lost packet.

The dispatcher admits a group while the rollouts in flight plus the group stay within the sum of the up replicas'
limits, and within `orchestrator.max_inflight`, which stays the upper bound. `floor` and `step` are one group
(a group is admitted whole); limits start at the cap's even share. A replica whose metrics cannot be read keeps its
limit. Against a simulated engine (tests/test_admission.py) additive increase and multiplicative decrease settle a
replica just under the load at which it preempts. Measured on vLLM with multi-turn rollouts and a small KV cache:
benchmarks/results.md ("Admission by KV-cache pressure").
"""

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from primerl.orchestrator.engine_load import EngineLoad

if TYPE_CHECKING:
    from primerl.orchestrator.replicas import Replicas

KV_FULL, KV_ROOM = 0.95, 0.85  # KV cache usage: at or above FULL with requests waiting is pressure; below ROOM, room
DECREASE = 0.75


class Limits:
    """The per-replica limits and their rule (module docstring), without I/O."""

    def __init__(self, replicas: int, cap: int, floor: int):
        self.cap, self.floor, self.step = cap, min(floor, cap), min(floor, cap)
        self.limits = [max(self.floor, cap // replicas)] * replicas
        self.preemptions: list[float | None] = [None] * replicas
        self.draining = [False] * replicas  # decreased, and more rollouts are outstanding than the new limit
        self.changes = 0  # counts limit changes: KvAdmission caches the total on it

    def adjust(self, index: int, load: EngineLoad, outstanding: int) -> bool:
        """Apply one reading of replica `index`; whether its limit changed."""
        seen, self.preemptions[index] = self.preemptions[index], load.preemptions
        preempted = seen is not None and load.preemptions > seen  # a restarted server starts again from 0
        limit = self.limits[index]
        self.draining[index] = self.draining[index] and outstanding > limit
        if self.draining[index]:
            return False
        if preempted or (load.waiting > 0 and load.kv_usage >= KV_FULL):
            new = max(self.floor, int(limit * DECREASE))
            self.draining[index] = outstanding > new
        elif load.waiting == 0 and load.kv_usage < KV_ROOM and outstanding >= limit - self.step:
            new = min(self.cap, limit + self.step)
        else:
            new = limit
        self.limits[index] = new
        if new != limit:
            self.changes += 1
        return new != limit

    def total(self, up: list[bool]) -> int:
        return min(self.cap, sum(limit for limit, is_up in zip(self.limits, up) if is_up))


class KvAdmission:
    """`Limits` fed from the replicas' metrics; `on_change` is called when a limit moves (the dispatcher re-checks)."""

    def __init__(self, replicas: "Replicas", cap: int, floor: int, period_s: float = 0.25):
        self.replicas, self.period_s = replicas, period_s
        self.limits = Limits(len(replicas), cap, floor)
        self.on_change: Callable[[], None] = lambda: None
        self._next = 0
        self._total, self._total_key = 0, (-1, -1)

    def allows(self, inflight: int) -> bool:
        return inflight <= self.total()

    def total(self) -> int:
        """The sum of the up replicas' limits, within the cap: summed again only after a limit or a replica's state
        changed (a sum over every replica at each admission is O(replicas))."""
        key = (self.limits.changes, self.replicas.load.taking_changes)
        if key != self._total_key:
            self._total, self._total_key = self.limits.total(self.replicas.up), key
        return self._total

    async def run(self) -> None:
        while True:
            index = self._next % len(self.replicas)
            self._next += 1
            if self.replicas.up[index]:
                load = await self.replicas.clients[index].engine_load()
                if load is not None and self.limits.adjust(index, load, self.replicas.outstanding[index]):
                    self.on_change()
            await asyncio.sleep(self.period_s / len(self.replicas))
