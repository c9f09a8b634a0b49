"""A resumed run keeps the settings it was started with: what changes the meaning of its trained steps, batches and
task stream (the model, the env, the optimizer and loss, the batch shape, sampling, the seed) is recorded when the
run starts (`<run>/run_settings.json`), and a rerun on the same directory with other values is refused with one line
naming each changed key, unless the user lists them in `allow_changes` (then the change is logged and recorded).
Settings that only place or watch the run (launcher, ledger, ports, replicas, workers, evals, `trainer.max_steps`)
may change freely."""

import dataclasses
import json
from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.transport.atomic import write_json
from primerl.transport.formats import RUN_DIR_FORMAT, check_format
from primerl.transport.run_dir import rollout_path, run_format_path, run_settings_path
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger

log = get_logger("train")
# prefixes of the flattened config that a resume must keep
KEPT = (
    "model.",
    "env.id",
    "env.args",
    "env.harness",
    "mixture",
    "seed",
    "sft.",
    "trainer.seq_len",
    "trainer.micro_batch_size",
    "trainer.mini_batches",
    "trainer.epochs",
    "trainer.optim.",
    "trainer.loss.",
    "orchestrator.batch_size",
    "orchestrator.group_size",
    "orchestrator.async_level",
    "orchestrator.max_off_policy_steps",
    "orchestrator.temperature",
    "orchestrator.max_tokens",
    "orchestrator.sampling_args",
)


def kept_settings(cfg: RunConfig) -> dict[str, str]:
    flat = _flatten(dataclasses.asdict(cfg))
    return {key: value for key, value in flat.items() if key.startswith(KEPT) or key in {k.rstrip(".") for k in KEPT}}


def recorded_settings(run_dir: Path, now: dict[str, str]) -> dict[str, str]:
    """The settings recorded at the run's first start, to compare with `now`. A setting of `now` that the record
    lacks, and that has a default, was added to primerl after the record was written: the run had its default."""
    recorded = json.loads(run_settings_path(run_dir).read_text())
    defaults = kept_settings(RunConfig())
    return {key: defaults[key] for key in now.keys() - recorded.keys() if key in defaults} | recorded


def _flatten(tree: object, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: json.dumps(tree, sort_keys=True, default=str)}


def check_resume(cfg: RunConfig, run_dir: Path) -> None:
    """Record the run's settings and directory format at its first start; on a resume, refuse a directory of another
    format (UnreadableFormat) and a change of settings not in `cfg.allow_changes`."""
    path, now = run_settings_path(run_dir), kept_settings(cfg)
    if not path.exists() or not rollout_path(run_dir, 0).exists():  # nothing produced yet: nothing to keep
        write_json(path, now, indent=1)
        write_json(run_format_path(run_dir), {"format": RUN_DIR_FORMAT})
        return
    check_run_format(run_dir)
    before = recorded_settings(run_dir, now)
    changed = sorted(key for key in before.keys() | now.keys() if before.get(key) != now.get(key))
    refused = [key for key in changed if not any(key == a or key.startswith(f"{a}.") for a in cfg.allow_changes)]
    if refused:
        shown = "; ".join(f"{key} {before.get(key, 'unset')} -> {now.get(key, 'unset')}" for key in refused[:4])
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        raise ConfigError(
            refused[0],
            f"{run_dir} was started with other settings ({shown}{more}); resume with them, "
            f"pass allow_changes=[{','.join(refused)}] to change them, or use a new run directory",
        )
    if changed:
        log.warning(f"resuming with changed settings (allow_changes): {', '.join(changed)}")
        write_json(path, now, indent=1)


def check_run_format(run_dir: Path) -> None:
    """Refuse a run directory whose format this release does not read (absent: written before formats were)."""
    path = run_format_path(run_dir)
    try:
        found = json.loads(path.read_text()).get("format") if path.exists() else None
    except (OSError, ValueError, AttributeError):
        found = "unreadable"
    check_format(found, RUN_DIR_FORMAT, "run directory", run_dir)
