"""Files and directories that appear whole or not at all: written under a temporary name beside the target, flushed to
the disk (fsync), then renamed into place (a rename within one directory is atomic on POSIX) and the directory flushed.
A crash, a kill or a full disk mid-write leaves only a dot-named temporary, which no reader looks at, and never a
partial target; after a power or node loss a target is the old one or the whole new one.

Appends (`append_lines`) are whole lines: a line torn by a kill mid-append is ended before the next one, so it stays
the only bad line and readers skip it. `when_disk_has_space` retries a write that failed for a full disk."""

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from primerl.utils.log import get_logger
from primerl.utils.wait import wait_until

log = get_logger("primerl")
STABLE_MARKER = "STABLE"  # the last file written into a published directory: readers load only directories with it
TEMPORARY_PREFIX = ".primerl-tmp-"  # every temporary of an atomic write: dot-named, so no reader looks at it


@contextmanager
def atomic_file(target: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `target` to write; it replaces `target` if the block ends without error."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{target.name}-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync(target.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(target: str | Path, value: object, indent: int | None = None) -> Path:
    """`value` as JSON at `target`, atomically: a reader sees the old file or the whole new one."""
    with atomic_file(target) as tmp:
        tmp.write_text(json.dumps(value, indent=indent))
    return Path(target)


def shared_staging_path(target: str | Path) -> Path:
    """The staging directory of `target` that several processes writing it together (the ranks of a checkpoint)
    find without being told: `.primerl-tmp-<name>.partial`."""
    return Path(target).with_name(f"{TEMPORARY_PREFIX}{Path(target).name}.partial")


@contextmanager
def atomic_dir(
    target: str | Path, mark_stable: bool = True, shared: bool = False, replace: bool = True
) -> Iterator[Path]:
    """Yields an empty staging directory beside `target`; if the block ends without error it is marked STABLE (when
    `mark_stable`) and renamed over `target` (an older `target` is removed first). `shared`: the staging directory
    is `shared_staging_path(target)`, for other processes to write into while the block runs. `replace=False`: a
    `target` that exists, or that another process renames into place first, is kept and the staging dropped (for
    content every writer computes alike)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if shared:
        staging = shared_staging_path(target)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o700)  # private, as mkdtemp's are
    else:
        staging = Path(tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{target.name}-", dir=target.parent))
    try:
        yield staging
        if mark_stable:
            (staging / STABLE_MARKER).touch()
        for folder, _, files in os.walk(staging):
            for name in files:
                _fsync(Path(folder, name))
            _fsync(folder)
        if target.exists():
            if not replace:
                return
            remove_published(target)
        try:
            os.rename(staging, target)
        except OSError as err:  # ENOTEMPTY / EEXIST: another writer's rename came first
            if replace or err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            return
        _fsync(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync(path: str | Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_lines(path: str | Path, lines: list[str]) -> None:
    """Append each of `lines` (without their newline) to `path` as whole lines, in one write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(line + "\n" for line in lines).encode()
    with open(path, "a+b") as f:
        if f.tell() > 0:  # a process killed mid-line left a torn line: start on a fresh one
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_WAIT_S = 1800.0  # then a WaitTimeout (a RunError) stops the process: half an hour full needs a person


def when_disk_has_space(write: Callable[[], None], what: str) -> None:
    """Call `write`; while it fails for a full disk (or quota), log it and call it again, with back-off up to 10 s,
    for at most DISK_FULL_WAIT_S. `write` must be safe to repeat (an atomic write, or an append of whole lines)."""
    failures = 0

    def attempt() -> bool:
        nonlocal failures
        try:
            write()
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            if not failures:
                log.warning(f"{what}: {e.strerror} ({e.filename or 'no file name'}); retrying until there is space")
            failures += 1
            return False
        return True

    wait_until(
        attempt, f"space on the disk to write {what}", DISK_FULL_WAIT_S, poll_s=0.5, max_poll_s=10, note_every_s=60
    )
    if failures:
        log.info(f"{what}: written after {failures} attempt(s) on a full disk")


def remove_published(path: str | Path) -> None:
    """Remove a published directory so that it disappears whole: renamed to a temporary name first (atomic), then
    deleted. A reader sees it STABLE and complete, or not at all, never a half-deleted one still marked STABLE (a fork
    copying a live parent's old checkpoint while the parent rotates it). A removal cut short leaves a temporary."""
    path = Path(path)
    doomed = path.with_name(f"{TEMPORARY_PREFIX}{path.name}-{os.urandom(4).hex()}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def is_stable(path: str | Path) -> bool:
    return (Path(path) / STABLE_MARKER).exists()


def stable_steps(folder: str | Path) -> list[int]:
    """The n of every STABLE `step_<n>` directory in `folder`, newest first."""
    steps = [int(p.name.split("_")[1]) for p in Path(folder).glob("step_*") if p.is_dir() and is_stable(p)]
    return sorted(steps, reverse=True)


def latest_stable(folder: str | Path) -> int | None:
    """The largest n of the STABLE `step_<n>` directories in `folder`, if any."""
    steps = stable_steps(folder)
    return steps[0] if steps else None


# what atomic_file (".primerl-tmp-<name>-XXXXXXXX.tmp") and atomic_dir (".primerl-tmp-<name>-XXXXXXXX", shared:
# ".primerl-tmp-<name>.partial") leave behind when killed: a name no user file has
_TEMPORARY = re.compile(r"^" + re.escape(TEMPORARY_PREFIX) + r".+(-[a-z0-9_]{8}(\.tmp)?|\.partial)$")


def stale_temporaries(root: str | Path) -> list[Path]:
    """Temporaries of interrupted atomic writes anywhere under `root` (never descending into them or dot-dirs).
    Only call it when no process writes under `root`."""
    found = []
    for folder, dirs, files in os.walk(root):
        found += [Path(folder, name) for name in dirs + files if _TEMPORARY.match(name)]
        dirs[:] = [d for d in dirs if not d.startswith(".")]
    return sorted(found)
