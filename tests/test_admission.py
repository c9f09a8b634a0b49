"""Admission by KV-cache pressure (primerl.orchestrator.admission): the per-replica rule on readings of vLLM's
metrics, against a simulated engine whose KV cache holds a fixed number of rollouts."""

from primerl.orchestrator.admission import Limits
from primerl.orchestrator.engine_load import EngineLoad


def test_the_rule_backs_off_on_preemption_or_a_full_queue_and_grows_only_when_used():
    limits = Limits(replicas=2, cap=64, floor=4)
    assert limits.limits == [32, 32]
    assert not limits.adjust(0, EngineLoad(8, 0, 0.9, 3), outstanding=32)  # a first reading: no preemption to see
    assert limits.adjust(0, EngineLoad(8, 0, 0.5, 5), outstanding=32) and limits.limits[0] == 24  # preempted: x3/4
    assert limits.adjust(0, EngineLoad(8, 2, 0.97, 5), outstanding=24) and limits.limits[0] == 18  # waiting, full
    assert not limits.adjust(0, EngineLoad(8, 0, 0.5, 5), outstanding=10)  # room, but the limit is not used
    assert limits.adjust(0, EngineLoad(8, 0, 0.5, 5), outstanding=17) and limits.limits[0] == 22  # used: + a group
    assert not limits.adjust(0, EngineLoad(8, 0, 0.9, 5), outstanding=22)  # between the marks: stays
    assert not limits.adjust(0, EngineLoad(8, 0, 0.5, 0), outstanding=10)  # a restarted server: not a preemption
    for _ in range(20):
        limits.adjust(1, EngineLoad(8, 0, 0.1, 0), outstanding=limits.limits[1])
    assert limits.limits[1] == 64 and limits.total([True, True]) == 64  # never past the cap, nor the total
    for _ in range(20):
        limits.adjust(1, EngineLoad(8, 0, 0.5, limits.preemptions[1] + 1), outstanding=4)
    assert limits.limits[1] == 4  # never under one group
    assert limits.total([True, False]) == limits.limits[0]  # a replica that is down adds nothing


def test_one_decrease_a_wave_the_rollouts_admitted_before_it_preempt_without_cutting_again():
    """Rollouts admitted under the old limit grow their contexts and preempt after the decrease: until the replica's
    outstanding rollouts have fallen to the new limit, its readings change nothing; after that a preemption counts."""
    limits = Limits(replicas=1, cap=64, floor=4)
    limits.adjust(0, EngineLoad(8, 0, 0.9, 0), outstanding=64)
    assert limits.adjust(0, EngineLoad(8, 3, 0.99, 2), outstanding=64) and limits.limits[0] == 48
    for outstanding, preemptions in ((60, 5), (55, 9), (49, 12)):  # the wave drains, preempting all the while
        assert not limits.adjust(0, EngineLoad(8, 3, 0.99, preemptions), outstanding=outstanding)
    assert limits.limits[0] == 48
    assert not limits.adjust(0, EngineLoad(8, 0, 0.9, 12), outstanding=48)  # drained, no new preemption: stays
    assert limits.adjust(0, EngineLoad(8, 0, 0.9, 13), outstanding=48) and limits.limits[0] == 36  # a new one counts


def test_a_replica_settles_under_the_load_at_which_its_engine_preempts():
    """A simulated engine whose KV cache holds `capacity` rollouts' worth: usage = outstanding / capacity, and each
    reading with more outstanding than fit adds preemptions. Demand is unlimited (every admitted rollout is used).
    From a start far above (the cap's share) and one far below, the limit settles near the capacity: mostly just
    under it, preempting in few readings, never stuck at the floor."""
    for start_cap in (256, 8):
        capacity, limits = 40, Limits(replicas=1, cap=256, floor=4)
        limits.limits[0] = start_cap
        preemptions, preempting, history = 0.0, 0, []
        for tick in range(400):
            outstanding = limits.limits[0]
            over = max(0, outstanding - capacity)
            preemptions += over
            load = EngineLoad(min(outstanding, capacity), over, min(1.0, outstanding / capacity), preemptions)
            limits.adjust(0, load, outstanding)
            if tick >= 200:
                history.append(limits.limits[0])
                preempting += over > 0
        mean = sum(history) / len(history)
        assert 0.6 * capacity <= mean <= capacity, (start_cap, mean)
        assert preempting <= 0.25 * len(history), (start_cap, preempting)
