"""Stopping child processes started with `start_new_session=True` (so each one leads its own process group)."""

import os
import signal
import subprocess
import time


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each live process's group, wait up to `grace_s` in all, then SIGKILL every group: grandchildren
    (vLLM's engine core, torchrun's ranks) may outlive their parent's exit."""
    alive = [p for p in processes if p.poll() is None]
    for process in alive:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in alive:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        _signal_group(process, signal.SIGKILL)
        process.wait()
