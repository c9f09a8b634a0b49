"""The one way primerl waits for something: poll a condition until it holds, with back-off, a deadline and a message
that names what was awaited.

`condition` returns something truthy when the wait is over (that value is returned) and may raise to end the wait
with its own error (a process that died while it was awaited). Polls start `poll_s` apart and double up to
`max_poll_s`; with `note_every_s`, a log line says what is still awaited and for how long, so a long wait is never
silent. Past `timeout_s` (None: no deadline) it raises `WaitTimeout`, a RunError that says what and how long.
"""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from primerl.utils.errors import RunError
from primerl.utils.log import get_logger

T = TypeVar("T")
log = get_logger("primerl")


class WaitTimeout(RunError):
    def __init__(self, what: str, timeout_s: float):
        super().__init__(f"{what}: not after {timeout_s:.0f}s")
        self.what, self.timeout_s = what, timeout_s


class _Polls:
    """Deadline, back-off and progress notes of one wait."""

    def __init__(
        self, what: str, timeout_s: float | None, poll_s: float, max_poll_s: float | None, note_every_s: float | None
    ):
        self.what, self.timeout_s, self.note_every_s = what, timeout_s, note_every_s
        self.delay, self.max_delay = poll_s, max_poll_s or poll_s
        self.started = self.noted = time.monotonic()

    def next_delay(self) -> float:
        """Seconds until the next poll; raises WaitTimeout past the deadline."""
        now = time.monotonic()
        if self.timeout_s is not None and now - self.started > self.timeout_s:
            raise WaitTimeout(self.what, self.timeout_s)
        if self.note_every_s is not None and now - self.noted >= self.note_every_s:
            log.info(f"still waiting for {self.what} ({now - self.started:.0f}s)")
            self.noted = now
        delay, self.delay = self.delay, min(self.delay * 2, self.max_delay)
        return delay


def wait_until(
    condition: Callable[[], T],
    what: str,
    timeout_s: float | None = None,
    poll_s: float = 0.2,
    max_poll_s: float | None = None,
    note_every_s: float | None = None,
) -> T:
    """Block until `condition()` is truthy; returns its value."""
    polls = _Polls(what, timeout_s, poll_s, max_poll_s, note_every_s)
    while not (result := condition()):
        time.sleep(polls.next_delay())
    return result


async def wait_until_async(
    condition: Callable[[], T | Awaitable[T]],
    what: str,
    timeout_s: float | None = None,
    poll_s: float = 0.2,
    max_poll_s: float | None = None,
    note_every_s: float | None = None,
) -> T:
    """`wait_until` on the event loop; `condition` may be a coroutine function."""
    polls = _Polls(what, timeout_s, poll_s, max_poll_s, note_every_s)
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(polls.next_delay())
