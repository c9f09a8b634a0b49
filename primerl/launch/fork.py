"""A fork: a new run that starts from another run's checkpoint at step N (`fork.run=DIR fork.step=N`), so that an
ablation branches from a shared prefix instead of training it again.

Before any process starts, the driver seeds the new run directory with what a resume of the parent at step N finds:
- `checkpoints/step_N/`, the model and optimizer state (with `fork.weights_only` its trainer_state.json says so, and
  the trainer loads the model alone: the optimizer starts fresh);
- the rollout batches of steps 0..N-1 (already trained; the orchestrator goes on after them, at the parent's task
  position, so the fork draws the tasks the parent drew after step N);
- the metrics rows of the steps before N (the fork's record shows the shared prefix; its own rows start at N);
and writes `fork.json` last. From there the fork is an ordinary resume: the trainer restores step N and publishes
policy N, the orchestrator writes batch N. Files are hard links where the filesystem allows (a fork costs no space)
and copies otherwise; nothing of the parent changes. An interrupted seeding is done again at the next start.

A fork keeps the parent's model (`model.*`, or the checkpoint would not load); any other setting may differ, which is
the point. Its MLflow run is tagged `forked_from` (the parent's run id), `fork_step` and `fork_run_dir`.
"""

import json
import os
import shutil
from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.launch.resume import check_run_format, kept_settings, recorded_settings
from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER, read_metrics
from primerl.transport.atomic import atomic_dir, atomic_file, is_stable, latest_stable, write_json
from primerl.transport.run_dir import (
    CHECKPOINT_STATE_FILE,
    checkpoint_path,
    checkpoints_root,
    fork_record_path,
    ledger_record_path,
    metrics_path,
    rollout_path,
    run_settings_path,
)
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger

log = get_logger("train")


def seed_fork(cfg: RunConfig, run_dir: Path) -> dict[str, str]:
    """Seed `run_dir` from `cfg.fork` (module docstring) unless it was seeded already; returns the MLflow tags that
    name the parent (none without a fork). A bad fork is one ConfigError, before anything is written."""
    if cfg.fork.run is None:
        return {}
    parent, record = Path(cfg.fork.run).resolve(), fork_record_path(run_dir)
    if record.exists():  # a resumed fork
        done = json.loads(record.read_text())
        if done["run"] != str(parent) or cfg.fork.step not in (None, done["step"]):
            raise ConfigError(
                "fork.run",
                f"{run_dir} was forked from {done['run']} at step {done['step']}; resume it with those "
                "or fork into a new run directory",
            )
        return fork_tags(done)
    step = check_parent(cfg, parent, run_dir)
    _seed_checkpoint(checkpoint_path(parent, step), checkpoint_path(run_dir, step), cfg.fork.weights_only)
    for k in range(step):
        _place(rollout_path(parent, k), rollout_path(run_dir, k))
    for process in (TRAINER, ORCHESTRATOR, EVAL):
        rows = [row for row in read_metrics(parent, process) if row["step"] < step]
        with atomic_file(metrics_path(run_dir, process)) as tmp:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ledger = ledger_record_path(parent)
    parent_run_id = json.loads(ledger.read_text()).get("run_id") if ledger.exists() else None
    done = {"run": str(parent), "step": step, "weights_only": cfg.fork.weights_only, "mlflow_run_id": parent_run_id}
    write_json(record, done, indent=1)
    state = "weights only, a fresh optimizer" if cfg.fork.weights_only else "weights and optimizer state"
    log.info(f"forked from {parent} at step {step} ({state}), with its {step} batches and metrics rows before it")
    return fork_tags(done)


def fork_tags(done: dict) -> dict[str, str]:
    tags = {"fork_step": str(done["step"]), "fork_run_dir": done["run"]}
    return tags | ({"forked_from": done["mlflow_run_id"]} if done.get("mlflow_run_id") else {})


def check_parent(cfg: RunConfig, parent: Path, run_dir: Path) -> int:
    """The step to fork at, after checking the parent has it and the fork can use it."""
    if parent == run_dir.resolve():
        raise ConfigError("fork.run", f"{parent} is this run's own directory; a fork goes into a new one")
    if not run_settings_path(parent).exists():
        raise ConfigError("fork.run", f"{parent} is not a run directory (it has no {run_settings_path(parent).name})")
    if run_settings_path(run_dir).exists():
        raise ConfigError("fork.run", f"{run_dir} holds a run of its own; fork into a new run directory")
    check_run_format(parent)
    now = kept_settings(cfg)
    before = recorded_settings(parent, now)
    for key in sorted(k for k in before.keys() | now.keys() if k.startswith("model.")):
        if before.get(key) != now.get(key):
            raise ConfigError(
                key,
                f"the fork's {now.get(key, 'unset')} is not its parent's {before.get(key, 'unset')}; a fork keeps the model",
            )
    stable = sorted(p.name for p in checkpoints_root(parent).glob("step_*") if is_stable(p))
    step = cfg.fork.step or latest_stable(checkpoints_root(parent))
    if step is None or not is_stable(checkpoint_path(parent, step)):
        have = ", ".join(stable) or "none"
        raise ConfigError(
            "fork.step",
            f"{parent} has no STABLE checkpoint of step {step} (it has: {have}); a run keeps its newest "
            "trainer.keep_checkpoints",
        )
    missing = [k for k in range(step) if not rollout_path(parent, k).exists()]
    if missing:
        raise ConfigError("fork.run", f"{parent} lacks the rollout batch of step {missing[0]}, which a fork keeps")
    return step


def _seed_checkpoint(source: Path, target: Path, weights_only: bool) -> None:
    """The parent's checkpoint, whole: a live parent that rotates it away meanwhile (it disappears whole,
    primerl.transport.atomic.remove_published) makes this a ConfigError, never a partial copy."""
    with atomic_dir(target, mark_stable=False) as staging:
        try:
            for file in sorted(source.iterdir()):
                _link_or_copy(file, staging / file.name)
        except FileNotFoundError:
            raise ConfigError(
                "fork.step",
                f"{source} was removed while it was copied (the parent runs and keeps its newest "
                "trainer.keep_checkpoints): fork at a newer step",
            ) from None
        if weights_only:  # the trainer loads the model alone (primerl.trainer.checkpoint.load_checkpoint)
            state = json.loads((source / CHECKPOINT_STATE_FILE).read_text())
            (staging / CHECKPOINT_STATE_FILE).unlink()
            (staging / CHECKPOINT_STATE_FILE).write_text(json.dumps(state | {"weights_only": True}, indent=1))


def _place(source: Path, target: Path) -> None:
    with atomic_file(target) as tmp:
        tmp.unlink()
        _link_or_copy(source, tmp)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(source, target)
