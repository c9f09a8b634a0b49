"""The MLflow record of a run: one writer (the launching process), explicit ids, no global MLflow state.

- Store: `ledger.tracking_uri`, else an embedded sqlite store `<store_dir>/mlflow.db` (artifacts beside it).
- Experiment: created once by name; a concurrent creator losing the race re-reads it (facts.md: never rely on
  `set_experiment` from several processes).
- Run: params = the flattened resolved config; tags = seeds, hardware, versions, git, launcher, SLURM ids, and
  MLflow's own (`mlflow.source.*`, `mlflow.user`, a description in `mlflow.note.content`); artifacts
  `config/resolved.yaml` (no interpolation left) and `config/composed.yaml` (as Hydra composed it).
  `<run>/ledger.json` keeps the MLflow run id, so a resumed run continues the same MLflow run.
- System metrics: MLflow's own monitor (`system/...`: CPU, memory, disk, network, GPU where present), sampled in the
  launching process every `ledger.system_metrics_s`.
- Sweeps: a parent run per Hydra sweep directory, created once under a file lock; each job is its child.
"""

import json
import math
import os
from contextlib import nullcontext
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from primerl.ledger.reach import wait_for_tracking_server
from primerl.ledger.run_info import (
    RecordSections,
    config_source_tags,
    env_tags,
    run_name,
    standard_tags,
    task_overrides,
)
from primerl.ledger.sweep import sweep_parent
from primerl.ledger.system_info import system_tags
from primerl.transport.atomic import write_json
from primerl.transport.run_dir import ledger_record_path
from primerl.utils.locks import locked
from primerl.utils.log import adopt_logger, get_logger
from primerl.utils.secrets import SECRET_KEYS, mask_params, mask_text

adopt_logger("mlflow")  # its own handler and format, installed at import: primerl's instead

MAX_PARAM_CHARS = 6000
EXPERIMENT_KIND, TRAINING_VIEW = "mlflow.experimentKind", "custom_model_development"  # MLflow 3 UI's views
TRAINING_VIEW_LINK = "workflowType=machine_learning"  # a UI link's query that opens the training view (MLflow 3.17)
log = get_logger(__name__)


_said: set[tuple[str, str, str]] = set()


def _configured(key: str, value: str | None, variable: str) -> str | None:
    """The config's value, else the environment variable's; says so when the config overrides a different one."""
    from_env = os.environ.get(variable)
    if value and from_env and from_env != value and (key, value, from_env) not in _said:
        _said.add((key, value, from_env))
        log.info(f"ledger.{key}={value} (from the config) overrides {variable}={from_env}")
    return value or from_env


def embedded_store(cfg: RecordSections) -> Path | None:
    """The embedded store's directory, or None when the run records to a tracking URI."""
    if _configured("tracking_uri", cfg.ledger.tracking_uri, "MLFLOW_TRACKING_URI"):
        return None
    return Path(cfg.ledger.store_dir).resolve()


def tracking_uri(cfg: RecordSections) -> str:
    store = embedded_store(cfg)
    if store is None:
        return _configured("tracking_uri", cfg.ledger.tracking_uri, "MLFLOW_TRACKING_URI")
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def experiment_name(cfg: RecordSections) -> str:
    return _configured("experiment_name", cfg.ledger.experiment_name, "MLFLOW_EXPERIMENT_NAME") or cfg.name


def flatten(tree: object, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out if out or not prefix else {prefix[:-1]: "{}"}
    return {prefix[:-1]: str(tree)[:MAX_PARAM_CHARS]}


def _experiment_id(client: MlflowClient, name: str, store_dir: Path | None) -> str:
    """The experiment `name`, created on first use; MLflow's UI opens a new one in its model-training view (runs,
    metrics, artifacts) rather than its GenAI view."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        artifacts = (store_dir / "mlartifacts" / name).as_uri() if store_dir else None
        return client.create_experiment(name, artifact_location=artifacts, tags={EXPERIMENT_KIND: TRAINING_VIEW})
    except Exception:  # noqa: BLE001 - another process created it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


class Ledger:
    def __init__(self, client: MlflowClient, run_id: str, run_dir: Path, experiment_id: str = ""):
        self.client = client
        self.run_id = run_id
        self.run_dir = run_dir
        self.experiment_id = experiment_id
        self._system_metrics = None

    @classmethod
    def open(
        cls,
        cfg: RecordSections,
        resolved: DictConfig,
        run_dir: Path,
        kind: str = "train",
        sweep_dir: Path | None = None,
        job_num: int | None = None,
    ) -> "Ledger":
        """Start (or, when `<run_dir>/ledger.json` exists, resume) this run's MLflow run."""
        store_dir = embedded_store(cfg)
        if store_dir is None:
            wait_for_tracking_server(tracking_uri(cfg), cfg.ledger.connect_timeout_s)
        # the first user of a new embedded store creates its tables; sweep jobs start together: one at a time
        with locked(store_dir / "mlflow.db") if store_dir else nullcontext():
            client = MlflowClient(tracking_uri(cfg))
            experiment = _experiment_id(client, experiment_name(cfg), store_dir)
        record = ledger_record_path(run_dir)
        if record.exists():
            run_id = json.loads(record.read_text())["run_id"]
            client.update_run(run_id, status="RUNNING")
            ledger = cls(client, run_id, run_dir, experiment)
            ledger._log_config(resolved)
            return ledger
        tags = {
            "primerl.kind": kind,
            "primerl.run_dir": str(run_dir),
            "seed": str(cfg.seed),
            "model.init_seed": str(cfg.model.init_seed),
            "launcher": cfg.launcher.name,
            **system_tags(),
            **config_source_tags(),
            **env_tags(cfg),
            **{key: str(value) for key, value in cfg.ledger.tags.items()},
        }
        tags |= standard_tags(cfg, kind, tags["git.commit"])
        if sweep_dir is not None:
            tags["mlflow.parentRunId"] = sweep_parent(client, experiment, sweep_dir)
            tags["primerl.sweep_dir"] = str(sweep_dir)
            tags["primerl.job_num"] = str(job_num)
        started = run_dir.name if sweep_dir is None else f"{sweep_dir.name}-{job_num}"
        run = client.create_run(experiment, run_name=run_name(cfg, kind, task_overrides(), started), tags=tags)
        ledger = cls(client, run.info.run_id, run_dir, experiment)
        params = mask_params(flatten(OmegaConf.to_container(resolved, resolve=True)))
        items = [Param(k[:250], v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            client.log_batch(ledger.run_id, params=items[i : i + 100])
        write_json(record, {"run_id": ledger.run_id, "tracking_uri": tracking_uri(cfg), "experiment_id": experiment})
        ledger._log_config(resolved)
        return ledger

    def _log_config(self, composed: DictConfig) -> None:
        secrets = [OmegaConf.select(composed, key) for key in SECRET_KEYS]
        for name, text in (
            ("resolved", OmegaConf.to_yaml(composed, resolve=True)),
            ("composed", OmegaConf.to_yaml(composed)),
        ):
            self.client.log_text(self.run_id, mask_text(text, secrets), f"config/{name}.yaml")

    def start_system_metrics(self, interval_s: float) -> None:
        """MLflow's system-metrics monitor for this run, continuing the steps of a resumed run; stopped by finish."""
        import logging

        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop lines, in its own format

        self._system_metrics = SystemMetricsMonitor(
            self.run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=self.client.tracking_uri
        )
        self._system_metrics.start()

    def log_metrics(
        self, step: int, values: dict[str, float | None], prefix: str = "", timestamp_ms: int | None = None
    ) -> None:
        import time

        ts = timestamp_ms or int(time.time() * 1000)
        metrics = [
            Metric(f"{prefix}{k}", float(v), ts, step)
            for k, v in values.items()
            if isinstance(v, int | float) and math.isfinite(v)
        ]
        for i in range(0, len(metrics), 500):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 500])

    def log_sample(self, row: dict, key: str) -> None:
        """One sampled rollout as an MLflow trace of this run (primerl.ledger.mlflow_traces), unless the run holds
        the one of `key` already."""
        from primerl.ledger.mlflow_traces import log_rollout_trace

        log_rollout_trace(self.client, self.run_id, self.experiment_id, row, key)

    def logged_model(self, name: str) -> str | None:
        """The id of this run's READY logged model `name` (primerl.ledger.logged_model), if it has one: one left
        PENDING by a driver killed while logging it, or FAILED, is logged again by a resume."""
        found = self.client.search_logged_models([self.experiment_id], f"source_run_id = '{self.run_id}'")
        return next((m.model_id for m in found if m.name == name and m.status == "READY"), None)

    def log_params(self, params: dict[str, str]) -> None:
        """Params are write-once in MLflow: keys this run already has are left as they are (a resumed run logs the
        same SFT results again)."""
        known = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in known]
        if new:
            self.client.log_batch(self.run_id, params=new)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if path.exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if self._system_metrics is not None:
            self._system_metrics.finish()
            self._system_metrics = None
        self.client.set_terminated(self.run_id, status=status)

    def url(self) -> str | None:
        """The run's page in the MLflow UI, when the store is a tracking server, in the UI's training view: MLflow
        3.17's UI opens in its GenAI view whatever the experiment's tag says, unless the link names the view."""
        uri = self.client.tracking_uri
        if not uri.startswith(("http://", "https://")):
            return None
        return f"{uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}?{TRAINING_VIEW_LINK}"
