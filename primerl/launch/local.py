"""Run the RL topology on this machine: inference server, orchestrator and trainer as child processes.

Each child is a Hydra app given the run's own overrides plus `output_dir=<run>`; each gets its own process group
and log (`<run>/logs/<name>.log`). If any child fails, or on Ctrl-C/SIGTERM, every child's process group is
terminated (SIGTERM, then SIGKILL after a grace period): no orphans. Progress: one line per trainer step.
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.config.schema import RunConfig
from primerl.launch.process import stop_process_groups
from primerl.metrics import read_metrics

if TYPE_CHECKING:
    from primerl.ledger.mlflow_ledger import Ledger

GRACE_S = 20.0


class ChildFailed(RuntimeError):
    pass


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


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


@dataclass
class LocalLauncher:
    run_dir: Path
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> Child:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        child = Child(name, process, log)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        stop_process_groups([c.process for c in self.children], GRACE_S)


def run_sft(cfg: RunConfig, overrides: list[str], run_dir: Path) -> None:
    """The SFT warm-start in the foreground (its progress bar shows), unless its checkpoint already exists."""
    from primerl.sft.checkpoint import sft_checkpoint_dir
    from primerl.trainer.weights import is_stable

    target = sft_checkpoint_dir(cfg)
    if not cfg.sft.enabled or is_stable(target):
        if cfg.sft.enabled:
            print(f"train: SFT warm-start found at {target}", flush=True)
        return
    print(f"train: SFT warm-start ({cfg.sft.steps} steps) -> {target}", flush=True)
    # the train run's ledger records the SFT results; the SFT process keeps none of its own
    cmd = module_command("primerl.sft", [*overrides, "ledger.enabled=false"], run_dir / "sft",
                         cfg.launcher.trainer_tasks_per_node)  # fmt: skip
    if subprocess.run(cmd, env=child_env()).returncode != 0:
        raise ChildFailed("SFT warm-start failed (its output is above)")


def run_local(cfg: RunConfig, overrides: list[str], ledger: "Ledger | None" = None) -> None:
    from primerl.ledger.mlflow_ledger import MetricsFollower
    from primerl.ledger.record import record_artifacts, record_sft

    run_dir = Path(cfg.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_sft(cfg, overrides, run_dir)
    follower = MetricsFollower(ledger) if ledger else None
    if ledger:
        record_sft(ledger, run_dir / "sft" / "sft_metrics.json")
    launcher = LocalLauncher(run_dir)
    cpu = cfg.inference.device == "cpu" or (cfg.inference.device == "auto" and not _has_cuda())
    # Ctrl-C and SIGTERM both stop the run, even when started with SIGINT ignored (a background job of a shell)
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        inference = launcher.spawn("inference", module_command("primerl.inference", overrides, run_dir), child_env())
        orchestrator = launcher.spawn("orchestrator", module_command("primerl.orchestrator", overrides, run_dir),
                                      child_env(threads=1))  # fmt: skip
        nproc = cfg.launcher.trainer_tasks_per_node
        # on CPU, vLLM pins one core; the trainer gets the rest
        trainer = launcher.spawn("trainer", module_command("primerl.trainer", overrides, run_dir, nproc),
                                 child_env(threads=max(1, (os.cpu_count() or 2) - 1) if cpu else None))  # fmt: skip
        print(f"train: run directory {run_dir} (logs in {run_dir / 'logs'})", flush=True)
        shown = 0
        while True:
            for child in launcher.children:
                code = child.process.poll()
                if code not in (None, 0):
                    raise ChildFailed(
                        f"{child.name} exited with code {code}; last lines of {child.log}:\n{child.tail()}"
                    )
            shown = _print_progress(run_dir, cfg, shown)
            if follower:
                follower.poll()
            if trainer.process.poll() == 0 and orchestrator.process.poll() == 0:
                break
            if inference.process.poll() is not None:
                raise ChildFailed(f"inference exited; last lines of {inference.log}:\n{inference.tail()}")
            time.sleep(1.0)
        _print_progress(run_dir, cfg, shown)
        print(f"train: done; {cfg.trainer.max_steps} steps in {run_dir}", flush=True)
    finally:
        launcher.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if follower and ledger:  # whatever happened, the record keeps everything produced so far
            follower.poll()
            record_artifacts(ledger, cfg, run_dir)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _print_progress(run_dir: Path, cfg: RunConfig, shown: int) -> int:
    orch = {row["step"]: row for row in read_metrics(run_dir, "orchestrator")}
    trainer_rows = read_metrics(run_dir, "trainer")
    for row in trainer_rows[shown:]:
        o = orch.get(row["step"], {})
        reward = o.get("reward/mean")
        print(f"step {row['step'] + 1}/{cfg.trainer.max_steps}  reward {reward if reward is None else f'{reward:.3f}'}"
              f"  loss {row['loss']:+.4f}  mismatch_kl {row['mismatch_kl']:.1e}  "
              f"gen {o.get('time/generate_s', 0):.1f}s  train {row['time/step_s']:.1f}s", flush=True)  # fmt: skip
    return len(trainer_rows)
