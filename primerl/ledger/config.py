"""Ledger group: where the MLflow record of each run goes."""

from dataclasses import dataclass

from primerl.utils.bounds import bounded


@dataclass
class LedgerConfig:
    enabled: bool = True
    # None: $MLFLOW_TRACKING_URI when set, else an embedded sqlite store, <store_dir>/mlflow.db. Set here, it wins
    # over the variable (and the run says so).
    tracking_uri: str | None = None
    store_dir: str = "outputs"  # relative to the launch directory; holds mlflow.db and mlartifacts/
    experiment_name: str | None = None  # None: $MLFLOW_EXPERIMENT_NAME when set, else the run's `name`
    sample_every: int = bounded(5, ge=1)  # log sample rollouts (JSON artifact and MLflow traces) every N steps
    # MLflow's system metrics (CPU, memory, disk, network, GPU) of the launching machine, sampled every N s; 0: off
    system_metrics_s: float = bounded(10.0, ge=0)
