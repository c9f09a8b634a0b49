"""Files and directories that appear whole or not at all: written under a temporary name beside the target, then
renamed into place (a rename within one directory is atomic on POSIX). A crash, a kill or a full disk mid-write leaves
only a dot-named temporary, which no reader looks at, and never a partial target."""

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
        os.replace(tmp, target)
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
def atomic_dir(target: str | Path, mark_stable: bool = True, shared: bool = False) -> Iterator[Path]:
    """Yields an empty staging directory beside `target`; if the block ends without error it is marked STABLE (when
    `mark_stable`) and renamed over `target` (an older `target` is removed first). `shared`: the staging directory
    is `shared_staging_path(target)`, for other processes to write into while the block runs."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if shared:
        staging = shared_staging_path(target)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    else:
        staging = Path(tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{target.name}-", dir=target.parent))
    try:
        yield staging
        if mark_stable:
            (staging / STABLE_MARKER).touch()
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_stable(path: str | Path) -> bool:
    return (Path(path) / STABLE_MARKER).exists()


def latest_stable(folder: str | Path) -> int | None:
    """The largest n of the STABLE `step_<n>` directories in `folder`, if any."""
    steps = [int(p.name.split("_")[1]) for p in Path(folder).glob("step_*") if p.is_dir() and is_stable(p)]
    return max(steps) if steps else None


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
