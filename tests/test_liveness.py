"""The supervisors' rule for a member that stopped answering (primerl.utils.liveness), driven by fake members on a
fake clock: each test ticks a supervisor the way primerl.envs.workers does (a health check in flight, an observation
per tick) and scripts what the member does."""

import logging

import pytest

from primerl.utils.liveness import Liveness, Pulse

TICK = 1.0


class FakeMember:
    """A member silent for its first `warmup_s` seconds, then answering a health check every `answer_s` seconds and
    finishing a rollout every `work_s` seconds (None: never)."""

    def __init__(self, answer_s: float | None, work_s: float | None, warmup_s: float = 0.0):
        self.answer_s, self.work_s, self.warmup_s = answer_s, work_s, warmup_s
        self.start = 0.0
        self.pulse = Pulse()

    def events(self, t0: float, t1: float) -> tuple[bool, int]:
        """(a health answer arrived, rollouts finished) in (t0, t1]."""

        def count(period: float | None) -> int:
            if period is None or t1 <= self.warmup_s:
                return 0
            return int((t1 - self.warmup_s) // period) - int((max(t0, self.warmup_s) - self.warmup_s) // period)

        return count(self.answer_s) > 0, count(self.work_s)


def supervise(liveness: Liveness, member: FakeMember, seconds: float, ticks: list[float] | None = None) -> float | None:
    """Tick until `seconds` of fake time pass; returns when the member was lost (None: it never was). `ticks`: the
    supervisor's own tick lengths (a starved supervisor runs late), TICK each by default."""
    now, step = member.start, iter(ticks or [])
    while now < member.start + seconds:
        elapsed = next(step, TICK)
        answered, finished = member.events(now, now + elapsed)
        now += elapsed
        for _ in range(finished):
            liveness.finished(member.pulse)
        if answered:
            member.pulse.answered()
        if liveness.observe(member.pulse, elapsed):
            liveness.lost(member.pulse)
            return now - member.start
    return None


def test_a_slow_member_that_keeps_finishing_work_is_never_lost():
    liveness = Liveness("test", timeout_s=3, grace_s=10, tick_s=TICK)
    # its health answers take 5 s (past the 3 s limit) but a rollout finishes every 2.5 s
    assert supervise(liveness, FakeMember(answer_s=None, work_s=2.5), seconds=120) is None
    # no work at all, health answers every 2.9 s: its loop turns
    assert supervise(liveness, FakeMember(answer_s=2.9, work_s=None), seconds=120) is None


def test_a_starved_supervisor_does_not_blame_its_members():
    liveness = Liveness("test", timeout_s=3, grace_s=3, tick_s=TICK)
    member = FakeMember(answer_s=1.0, work_s=None)
    member.pulse.finished = 1
    # the supervisor's loop sleeps 20 s at once; the answer waiting for it counts at its next tick
    assert supervise(liveness, member, seconds=60, ticks=[1.0, 20.0, 1.0]) is None


def test_a_blocked_member_is_lost_within_its_limit():
    liveness = Liveness("test", timeout_s=3, grace_s=10, tick_s=TICK)
    served = FakeMember(answer_s=None, work_s=None)
    served.pulse.finished = 5  # it worked, then its loop blocked
    assert supervise(liveness, served, seconds=60) == pytest.approx(4.0)  # more than 3 s of silence, seen at a tick
    fresh = FakeMember(answer_s=None, work_s=None)
    assert supervise(liveness, fresh, seconds=60) == pytest.approx(11.0)  # a fresh one gets its 10 s of grace
    # a blocked member is lost even while the supervisor runs late
    late = FakeMember(answer_s=None, work_s=None)
    late.pulse.finished = 1
    assert supervise(liveness, late, seconds=600, ticks=[30.0] * 20) is not None


def test_fresh_losses_back_the_deadline_off_and_work_restores_it(caplog):
    caplog.set_level(logging.INFO)
    liveness = Liveness("env workers of test", timeout_s=3, grace_s=5, tick_s=TICK, max_backoff=8)
    lost_after = []
    for _ in range(4):  # each replacement is silent for 12 s (loaded), then works and answers every second
        lost_after.append(supervise(liveness, FakeMember(answer_s=1.0, work_s=1.0, warmup_s=12.0), seconds=120))
    # 5 s, then 10 s of grace lose them; with 20 s the third serves, and so does the fourth: the load is still there
    # (the third needed more than the plain grace), so its work does not reset the grace to start the spiral again
    assert lost_after == [6.0, 11.0, None, None]
    assert liveness.backoff == 4
    assert "2 lost before finishing any work; the grace of new ones backs off to 20s" in caplog.text
    # a new member that works within the plain grace says the load is gone
    assert supervise(liveness, FakeMember(answer_s=1.0, work_s=1.0, warmup_s=2.0), seconds=60) is None
    assert liveness.backoff == 1 and "grace back to 5s" in caplog.text
    # the backoff is bounded: a spiral of members that never work is found within grace_s * max_backoff
    for _ in range(6):
        lost = supervise(liveness, FakeMember(answer_s=None, work_s=None), seconds=600)
    assert liveness.backoff == 8 and lost == pytest.approx(41.0)


def test_a_member_lost_after_working_does_not_back_off():
    liveness = Liveness("test", timeout_s=3, grace_s=5, tick_s=TICK)
    for _ in range(3):
        member = FakeMember(answer_s=None, work_s=None)
        member.pulse.finished = 1
        supervise(liveness, member, seconds=60)
    assert liveness.backoff == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        Liveness("test", timeout_s=0, grace_s=1, tick_s=1)
