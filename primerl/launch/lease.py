"""The driver's lease over its SLURM jobs: a job whose driver is gone stops by itself.

Locally a driver killed with -9 takes its children along (primerl.utils.parent_death); SLURM jobs run on other nodes
and would keep their GPUs until their time limit. So while it lives the driver renews `<run>/driver.lease` (its
modification time, every RENEW_S, on the run's shared filesystem), and each job checks it as it waits for its
process: a lease not renewed for `launcher.driver_lease_s` stops the job's process and ends the job (not requeued).
A rerun of the command takes the run over again (it resumes from its checkpoints and batches).
"""

import threading
import time
from pathlib import Path

from primerl.transport.run_dir import driver_lease_path

RENEW_S = 10.0


class DriverLease:
    """The driver's side: renews the lease from a thread until `stop`."""

    def __init__(self, run_dir: str | Path):
        self.path = driver_lease_path(run_dir)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self.renew()
            self._thread = threading.Thread(target=self._run, name="driver-lease", daemon=True)
            self._thread.start()

    def renew(self) -> None:
        self.path.touch()

    def _run(self) -> None:
        while not self._stopped.wait(RENEW_S):
            try:
                self.renew()
            except OSError:  # a filesystem hiccup: the next renewal may go through, well within the lease
                continue

    def stop(self) -> None:
        self._stopped.set()


def lease_lapsed_s(run_dir: str | Path, lease_s: float, since: float) -> float | None:
    """How long the driver's lease has gone unrenewed, when that is longer than `lease_s` (None while it holds). A
    lease not written at all counts from `since` (the job's start, as a time.time() value)."""
    path = driver_lease_path(run_dir)
    try:
        renewed = path.stat().st_mtime
    except FileNotFoundError:
        renewed = since
    lapsed = time.time() - max(renewed, since)
    return lapsed if lapsed > lease_s else None
