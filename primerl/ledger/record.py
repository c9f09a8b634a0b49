"""What the launching process records for a run, on top of the live metrics: SFT results, artifacts, checkpoints."""

import json
from pathlib import Path

from primerl.config.ledger import LedgerConfig
from primerl.config.model import ModelConfig
from primerl.ledger.logged_model import record_policy
from primerl.ledger.mlflow_ledger import Ledger
from primerl.ledger.wandb_tracker import WandbTracker
from primerl.transport.run_dir import reward_plot_path, samples_path, weights_path
from primerl.transport.weights import latest_stable_version
from primerl.utils.log import get_logger

log = get_logger(__name__)

SFT_RESULTS = ("loss_final", "train_wall_s")


def record_sft(ledger: "Ledger | WandbTracker", metrics_file: Path) -> None:
    """The SFT loss curve as metric `sft/loss` by SFT step; its single-valued results as params `sft.result.*`
    (one value per run, not a one-point curve on another step scale)."""
    if not metrics_file.exists():
        return
    sft = json.loads(metrics_file.read_text())
    for step, loss in enumerate(sft.get("losses", [])):
        ledger.log_metrics(step, {"loss": loss}, "sft/")
    ledger.log_params({f"sft.result.{k}": f"{sft[k]:.4g}" for k in SFT_RESULTS if k in sft})
    ledger.set_tags({"checkpoint.sft": sft.get("checkpoint", "")})


def record_artifacts(ledger: Ledger, settings: LedgerConfig, model: ModelConfig, run_dir: Path) -> None:
    """The overrides, the reward plot, sample rollouts every `ledger.sample_every` steps, checkpoint paths."""
    ledger.log_artifact(run_dir / ".hydra" / "overrides.yaml", "config")
    if reward_plot_path(run_dir).exists():  # drawn by the run loop at the end (primerl.launch.supervise)
        ledger.log_artifact(reward_plot_path(run_dir))
    samples_file = samples_path(run_dir)
    if samples_file.exists():
        by_step: dict[int, list[dict]] = {}
        for number, line in enumerate(samples_file.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
                by_step.setdefault(int(row["step"]), []).append(row)
            except (ValueError, KeyError, TypeError):  # a line torn by a kill: the record goes on without it
                log.warning(f"{samples_file}: line {number} is not a sample row; left out of the record")
        for step, rows in sorted(by_step.items()):
            if step % max(1, settings.sample_every) == 0 or step == max(by_step):
                ledger.client.log_text(ledger.run_id, json.dumps(rows, indent=1), f"samples/step_{step:06d}.json")
    latest = latest_stable_version(run_dir)
    if latest is not None:
        ledger.set_tags({"checkpoint.final": str(weights_path(run_dir, latest)), "checkpoint.final_step": str(latest)})
        record_policy(ledger, settings, model, run_dir, weights_path(run_dir, latest), latest)
