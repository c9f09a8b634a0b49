"""What every launcher shares: the command line of a process, its environment, and stopping process groups.

A process of a run is `python -m primerl.<name> <the run's overrides> output_dir=<run>`: a Hydra app that logs under
`<run>/logs/` and writes nothing else outside the run directory (and the model cache).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class ChildFailed(RuntimeError):
    """A process (or SLURM job) of the run ended badly; the message says which, how, and ends with its last log lines."""


def module_command(module: str, overrides: list[str], run_dir: Path, nproc: int = 1) -> list[str]:
    name = module.rsplit(".", 1)[-1]
    args = [*overrides, f"output_dir={run_dir}", f"hydra.run.dir={run_dir}/logs/{name}", "hydra.output_subdir=null"]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", module, *args]  # fmt: skip
    return [sys.executable, "-m", module, *args]


def child_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def log_tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each live process's group, wait up to `grace_s` in all, then SIGKILL every group: grandchildren
    (vLLM's engine core, torchrun's ranks) may outlive their parent's exit. Each process must lead its own group
    (started with `start_new_session=True`)."""
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
