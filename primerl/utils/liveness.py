"""When a supervised member that stopped answering counts as lost: one rule for env workers (primerl.envs.workers)
and inference replicas (primerl.orchestrator.watcher).

A supervisor that kills a slow member and then its replacement for the same slowness turns load into an outage (on a
2-core machine, env workers starved of CPU missed 3 s health checks; each replacement took 11-20 s to start and was
killed before it served one rollout). So:

- **Signs of life are health answers and finished work.** A member whose loop is turning, however slowly, finishes
  rollouts or answers checks; a blocked loop does neither. A member is lost only after `limit` seconds of neither.
- **Only silence the supervisor watched counts.** Each observation adds at most `2 * tick_s`: a supervisor whose own
  loop ran late (starved of CPU) has not read the answers waiting for it, and does not blame the member for that.
- **A fresh member gets a grace period.** Until it has finished its first piece of work its limit is `grace_s` (at
  least `timeout_s`): its first rollouts pay imports and warm-up. A member that has worked is held to `timeout_s`.
- **Fresh losses back off.** Each member lost before it finished any work doubles the grace of those after it (up to
  `max_backoff` times), with a log line. The grace comes back down only when a fresh member finishes its first work
  within the plain `grace_s` (the load is gone): a member that needed the longer grace says the load is still there,
  and resetting then would start the spiral again. A blocked member is still found within `grace_s * max_backoff`
  plus one tick.
"""

import time
from dataclasses import dataclass, field

from primerl.utils.log import get_logger

log = get_logger(__name__)


@dataclass
class Pulse:
    """One member's signs of life as its supervisor has seen them."""

    silent_s: float = 0.0  # watched silence since the last sign of life
    watched_s: float = 0.0  # watched time since it was started
    finished: int = 0  # pieces of work it finished (answered), cumulative
    seen_at: float = field(default_factory=time.monotonic)  # its last sign of life (or its start)

    def answered(self) -> None:
        """A health answer: the member's loop turns."""
        self.silent_s = 0.0
        self.seen_at = time.monotonic()


class Liveness:
    def __init__(self, what: str, timeout_s: float, grace_s: float, tick_s: float, max_backoff: int = 8):
        if timeout_s <= 0 or tick_s <= 0 or max_backoff < 1:
            raise ValueError(f"{what}: timeout_s and tick_s must be > 0 and max_backoff >= 1")
        self.what, self.timeout_s, self.grace_s = what, timeout_s, max(grace_s, timeout_s)
        self.tick_s, self.max_backoff = tick_s, max_backoff
        self.fresh_losses = 0  # members lost in a row before they finished any work

    @property
    def backoff(self) -> int:
        return min(2**self.fresh_losses, self.max_backoff)

    def limit(self, pulse: Pulse) -> float:
        """Seconds of watched silence after which this member is lost."""
        return self.timeout_s if pulse.finished else self.grace_s * self.backoff

    def observe(self, pulse: Pulse, elapsed_s: float) -> bool:
        """Count `elapsed_s` of silence just watched (at most two ticks of it); True when the member is now lost."""
        watched = min(max(elapsed_s, 0.0), 2 * self.tick_s)
        pulse.silent_s += watched
        pulse.watched_s += watched
        return pulse.silent_s > self.limit(pulse)

    def finished(self, pulse: Pulse) -> None:
        """The member finished a piece of work (a rollout came back, whatever its outcome)."""
        first = not pulse.finished
        pulse.finished += 1
        pulse.silent_s = 0.0
        pulse.seen_at = time.monotonic()
        if first and self.fresh_losses and pulse.watched_s <= self.grace_s:
            log.info(
                "%s: a new member worked within %.0fs; grace back to %.0fs", self.what, pulse.watched_s, self.grace_s
            )
            self.fresh_losses = 0

    def lost(self, pulse: Pulse) -> None:
        """The member was lost for its silence. One lost before it finished any work backs the grace off (a crash
        says nothing of how long a new member needs, and is not counted)."""
        if pulse.finished:
            return
        before = self.backoff
        self.fresh_losses += 1
        if self.backoff > before:
            log.warning(
                "%s: %d lost before finishing any work; the grace of new ones backs off to %.0fs",
                self.what,
                self.fresh_losses,
                self.grace_s * self.backoff,
            )
