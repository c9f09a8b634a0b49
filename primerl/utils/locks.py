"""An exclusive file lock held for a block: how processes that share a cache or store take turns."""

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from primerl.utils.log import get_logger


@contextmanager
def locked(path: Path, waiting: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `<path>.lock` (beside `path`, created as needed) for the block. `waiting`: logged
    when another process holds the lock, before waiting for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                get_logger("primerl").info(waiting)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
