"""The chaos soak's faults other than kill -9: each is injected into a running run, which must go on by itself.

- `TrackingServer`: the run's MLflow tracking server (sqlite behind it), which the soak kills and restarts
  ("store_down") and whose database it locks exclusively ("store_locked");
- `RolloutsDisk`: a small tmpfs mounted on the run's `rollouts/`, which the soak fills to the last byte ("disk_full");
  the orchestrator's batch, metrics and sample writes stall there, never tear or drop;
- `arm_nonfinite_step`: the trainer's next step on rank 0 gets a NaN loss (primerl.utils.failpoints);
- `tear_samples_line`: what a kill mid-append leaves in `rollouts/samples.jsonl`;
- `damage_newest_checkpoint`: the newest checkpoint truncated or missing a file, as a shared filesystem may deliver it;
- `target_pid`: the process a kill -9 hits;
- `second_run`: the same command into another run directory while the first runs: refused at once, with one line,
  leaving nothing behind and the first run undisturbed.
"""

import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from primerl.launch.leftovers import run_processes
from primerl.transport.atomic import latest_stable
from primerl.transport.run_dir import checkpoint_path, checkpoints_root, samples_path
from primerl.utils.failpoints import FAILPOINTS_ENV
from primerl.utils.process import free_port

ROOT = Path(__file__).resolve().parents[1]  # the checkout the soak's commands run in
OUTAGE_S = 20.0  # how long the store stays down or locked, and the disk full
SECOND_RUN_LIMIT_S = 180.0  # the second run must be refused within this (imports and config take most of it)


class TrackingServer:
    """`mlflow server` on a free loopback port, over `<root>/mlflow.db` and `<root>/mlartifacts`."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        cmd += ["--artifacts-destination", str(self.root / "mlartifacts")]
        log = open(self.root / "server.log", "a")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"the MLflow server did not start; see {self.root / 'server.log'}")

    def kill(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def lock(self, seconds: float) -> threading.Thread:
        """Hold an exclusive lock on the store's database for `seconds`, on a thread (returned, running)."""

        def hold() -> None:
            db = sqlite3.connect(self.root / "mlflow.db", timeout=60, isolation_level=None)
            db.execute("BEGIN EXCLUSIVE")
            time.sleep(seconds)
            db.execute("ROLLBACK")
            db.close()

        thread = threading.Thread(target=hold, daemon=True)
        thread.start()
        return thread


class RolloutsDisk:
    """A tmpfs of `size_mb` on `<run>/rollouts` (needs root; `available` says whether it could be mounted)."""

    def __init__(self, run: Path, size_mb: int = 64):
        self.path = run / "rollouts"
        self.path.mkdir(parents=True, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(self.path)]
        self.available = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
        self.filler = self.path / "disk-filler"

    def fill(self) -> None:
        """Write until the disk is full (ENOSPC)."""
        chunk = b"\0" * (1 << 20)
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    chunk = chunk[: len(chunk) // 2]
                    if not chunk:
                        return

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount_keeping_files(self) -> None:
        """Copy what the run wrote out of the tmpfs, unmount it, and put the copy in its place."""
        if not self.available:
            return
        self.free()
        kept = Path(tempfile.mkdtemp(prefix="primerl-chaos-rollouts-"))
        shutil.copytree(self.path, kept, dirs_exist_ok=True)
        subprocess.run(["umount", str(self.path)], check=True)
        shutil.copytree(kept, self.path, dirs_exist_ok=True)
        shutil.rmtree(kept)


def arm_nonfinite_step(failpoints: Path) -> None:
    failpoints.mkdir(parents=True, exist_ok=True)
    (failpoints / "trainer.nonfinite_loss").touch()


def failpoint_env(failpoints: Path) -> dict[str, str]:
    return {**os.environ, FAILPOINTS_ENV: str(failpoints)}


def tear_samples_line(run: Path) -> None:
    """The first half of a sample row without its newline, as a writer killed mid-append leaves it."""
    with open(samples_path(run), "a") as f:
        f.write('{"step": 0, "task": "torn by the chaos so')


def damage_newest_checkpoint(run: Path, missing: bool = False) -> Path | None:
    """Truncate the largest file of the newest STABLE checkpoint to half, or remove it (`missing`), as a shared
    filesystem that delivered it short or not at all leaves it; the next start must set the checkpoint aside and
    resume from the one before. Returns the checkpoint."""
    step = latest_stable(checkpoints_root(run))
    if step is None:
        return None
    path = checkpoint_path(run, step)
    largest = max((p for p in path.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    if missing:
        largest.unlink()
    else:
        os.truncate(largest, largest.stat().st_size // 2)
    return path


def second_run(cmd: list[str], cwd: Path, work: Path, failpoints: Path) -> dict:
    """Start `cmd` (the soak's command) into `<work>/second`; it must exit non-zero within SECOND_RUN_LIMIT_S,
    naming the port in one line, with no process of it left. Returns what was seen."""
    work.mkdir(parents=True, exist_ok=True)
    second = work / "second"
    cmd = [a if not a.startswith("hydra.run.dir=") else f"hydra.run.dir={second}" for a in cmd]
    started = time.monotonic()
    log = work / "second-run.log"
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=failpoint_env(failpoints))
        try:
            process.wait(timeout=SECOND_RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    text = log.read_text()
    # refused at its preflight (the port is taken), or, when the first run's server was between two starts then, by
    # its own server's start (the server on the port is not this run's)
    errors = [line for line in text.splitlines() if "already in use" in line or "not this run's" in line]
    return {
        "exit": process.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "refused": process.returncode not in (0, -signal.SIGKILL) and bool(errors),
        "line": errors[0][-160:] if errors else text.strip().splitlines()[-1:],
        "left": run_processes(second),
    }


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def target_pid(kind: str, run: Path, driver: subprocess.Popen) -> int | None:
    """The process a kill of `kind` hits (torn_samples: the orchestrator; damaged_checkpoint: the trainer;
    store_down_at_start: the driver; dies_at_first_request: the vLLM server)."""
    if kind in ("driver", "store_down_at_start"):
        return driver.pid
    kind = {"torn_samples": "orchestrator", "damaged_checkpoint": "trainer", "dies_at_first_request": "vllm"}.get(
        kind, kind
    )
    marks = {"vllm": b"vllm.entrypoints.openai.api_server"} | {
        k: f"-m\0primerl.entrypoints.{k}\0".encode() for k in ("trainer", "orchestrator", "inference")
    }
    pids = [p for p in run_processes(run) if marks[kind] in cmdline(p)]
    return min(pids) if pids else None


def wait_for(condition, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()
