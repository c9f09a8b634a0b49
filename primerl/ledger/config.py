"""Ledger group: where the MLflow record of each run goes."""

from dataclasses import dataclass


@dataclass
class LedgerConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # None: an embedded sqlite store, <store_dir>/mlflow.db
    store_dir: str = "outputs"  # relative to the launch directory; holds mlflow.db and mlartifacts/
    experiment_name: str = "${name}"
    sample_every: int = 5  # log sample rollouts as an artifact every N steps
