"""What every launcher shares: the command line of a process, its environment and its log.

A process of a run is `python -m primerl.<name> <the run's overrides> output_dir=<run>`: a Hydra app that logs under
`<run>/logs/` and writes nothing else outside the run directory (and the model cache).
"""

import os
import sys
from pathlib import Path


class ChildFailed(RuntimeError):
    """A process (or SLURM job) of the run ended badly; the message says which, how, and ends with its last log lines."""


def module_command(module: str, overrides: list[str], run_dir: Path, nproc: int = 1) -> list[str]:
    name = module.rsplit(".", 1)[-1]
    args = [*overrides, f"output_dir={run_dir}", f"hydra.run.dir={run_dir}/logs/{name}", "hydra.output_subdir=null"]
    if nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            module,
            *args,
        ]
    return [sys.executable, "-m", module, *args]


def child_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def log_tail(log: Path, lines: int = 25) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])
