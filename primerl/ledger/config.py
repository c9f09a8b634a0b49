"""Ledger group: where the MLflow record of each run goes."""

from dataclasses import dataclass


@dataclass
class LedgerConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # None: sqlite in the output folder
    experiment_name: str = "primerl"
