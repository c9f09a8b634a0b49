"""A Hydra callback (listed in primerl/conf/config.yaml) that closes a sweep's MLflow parent run when the multirun ends.

It runs in the process that launched the sweep, whatever the launcher (basic, submitit local or SLURM, Optuna).
"""

from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepLedgerCallback(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from primerl.ledger.sweep import finish_sweep

        finish_sweep(Path(config.hydra.sweep.dir).resolve())
