"""Ledger group: where the record of each run goes: MLflow (`enabled`), W&B (`wandb.enabled`), or both; and the live
metrics each process serves to Prometheus (`prometheus.port`)."""

from dataclasses import dataclass, field

from primerl.utils.bounds import bounded


@dataclass
class WandbConfig:
    """Weights & Biases, beside or instead of MLflow: the same params, metrics and sampled rollouts."""

    enabled: bool = False
    project: str | None = None  # None: the MLflow experiment's name (ledger.experiment_name, else the run's name)
    entity: str | None = None  # None: W&B's default for your login
    mode: str = "online"  # online | offline (written under <run>/wandb; `wandb sync` uploads it later) | disabled


@dataclass
class PrometheusConfig:
    """Live metrics in Prometheus' format (primerl.utils.prometheus): each process serves its latest values at
    `http://host:port+offset/metrics`, the orchestrator at `port`, the trainer (rank 0) at port+1, the inference
    process at port+2. A scrape needs `Authorization: Bearer <token>`: $PRIMERL_METRICS_TOKEN when set, else the
    run's key (inference.api_key)."""

    port: int = bounded(0, ge=0, le=65533)  # 0: off
    host: str = "127.0.0.1"  # another address needs a token: a scrape token or the run's key


@dataclass
class LedgerConfig:
    enabled: bool = True
    # None: $MLFLOW_TRACKING_URI when set, else an embedded sqlite store, <store_dir>/mlflow.db. Set here, it wins
    # over the variable (and the run says so).
    tracking_uri: str | None = None
    # how long a run waits at start for a tracking server that does not answer, then stops with one line
    connect_timeout_s: float = bounded(60.0, ge=0)
    store_dir: str = "outputs"  # relative to the launch directory; holds mlflow.db and mlartifacts/
    experiment_name: str | None = None  # None: $MLFLOW_EXPERIMENT_NAME when set, else the run's `name`
    sample_every: int = bounded(5, ge=1)  # log sample rollouts (JSON artifact and MLflow traces) every N steps
    # MLflow's system metrics (CPU, memory, disk, network, GPU) of the launching machine, sampled every N s; 0: off
    system_metrics_s: float = bounded(10.0, ge=0)
    # the final policy as the run's logged model, its files in the store up to log_model_max_mb (primerl.ledger.logged_model);
    # off, or past the size, the model records where the weights are
    log_model: bool = True
    log_model_max_mb: int = bounded(2048, ge=0)
    # extra MLflow tags on the run (`+ledger.tags.team=rl`); `primerl rerun` sets rerun_of to the run it repeats
    tags: dict[str, str] = field(default_factory=dict)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
