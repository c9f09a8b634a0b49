"""The MLflow record of a run: one writer (the launching process), explicit ids, no global MLflow state.

- Store: `ledger.tracking_uri`, else an embedded sqlite store `<store_dir>/mlflow.db` (artifacts beside it).
- Experiment: created once by name; a concurrent creator losing the race re-reads it (facts.md: never rely on
  `set_experiment` from several processes).
- Run: params = the flattened resolved config; tags = seeds, hardware, versions, git, launcher, SLURM ids.
  `<run>/ledger.json` keeps the MLflow run id, so a resumed run continues the same MLflow run.
- Sweeps: a parent run per Hydra sweep directory, created once under a file lock; each job is its child.
"""

import fcntl
import json
import math
from contextlib import contextmanager, nullcontext
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from primerl.config.schema import RunConfig
from primerl.ledger.system_info import system_tags
from primerl.transport.run_dir import ledger_record_path

PARENT_FILE = "ledger_parent.json"
MAX_PARAM_CHARS = 6000


def tracking_uri(cfg: RunConfig) -> str:
    if cfg.ledger.tracking_uri:
        return cfg.ledger.tracking_uri
    store = Path(cfg.ledger.store_dir).resolve()
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def flatten(tree: object, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out |= flatten(value, f"{prefix}{key}.")
        return out if out or not prefix else {prefix[:-1]: "{}"}
    return {prefix[:-1]: str(tree)[:MAX_PARAM_CHARS]}


def _experiment_id(client: MlflowClient, name: str, store_dir: Path | None) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        artifacts = (store_dir / "mlartifacts" / name).as_uri() if store_dir else None
        return client.create_experiment(name, artifact_location=artifacts)
    except Exception:  # noqa: BLE001 - another process created it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Ledger:
    def __init__(self, client: MlflowClient, run_id: str, run_dir: Path):
        self.client = client
        self.run_id = run_id
        self.run_dir = run_dir

    @classmethod
    def open(cls, cfg: RunConfig, resolved: DictConfig, run_dir: Path, kind: str = "train",
             sweep_dir: Path | None = None, job_num: int | None = None) -> "Ledger":  # fmt: skip
        """Start (or, when `<run_dir>/ledger.json` exists, resume) this run's MLflow run."""
        store_dir = None if cfg.ledger.tracking_uri else Path(cfg.ledger.store_dir).resolve()
        # the first user of a new embedded store creates its tables; sweep jobs start together: one at a time
        with _locked(store_dir / "mlflow.db") if store_dir else nullcontext():
            client = MlflowClient(tracking_uri(cfg))
            experiment = _experiment_id(client, cfg.ledger.experiment_name, store_dir)
        record = ledger_record_path(run_dir)
        if record.exists():
            run_id = json.loads(record.read_text())["run_id"]
            client.update_run(run_id, status="RUNNING")
            return cls(client, run_id, run_dir)
        tags = {"primerl.kind": kind, "primerl.run_dir": str(run_dir), "seed": str(cfg.seed),
                "model.init_seed": str(cfg.model.init_seed), "launcher": cfg.launcher.name, **system_tags()}  # fmt: skip
        if sweep_dir is not None:
            tags["mlflow.parentRunId"] = cls._sweep_parent(client, experiment, sweep_dir)
            tags["primerl.sweep_dir"] = str(sweep_dir)
            tags["primerl.job_num"] = str(job_num)
        name = run_dir.name if sweep_dir is None else f"{sweep_dir.name}-{job_num}"
        run = client.create_run(experiment, run_name=f"{cfg.name}-{name}", tags=tags)
        ledger = cls(client, run.info.run_id, run_dir)
        params = flatten(OmegaConf.to_container(resolved, resolve=True))
        items = [Param(k[:250], v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            client.log_batch(ledger.run_id, params=items[i : i + 100])
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"run_id": ledger.run_id, "tracking_uri": tracking_uri(cfg),
                                      "experiment_id": experiment}))  # fmt: skip
        return ledger

    @staticmethod
    def _sweep_parent(client: MlflowClient, experiment: str, sweep_dir: Path) -> str:
        path = sweep_dir / PARENT_FILE
        with _locked(path):
            if path.exists():
                return json.loads(path.read_text())["run_id"]
            run = client.create_run(experiment, run_name=f"sweep-{sweep_dir.name}",
                                    tags={"primerl.kind": "sweep", "primerl.sweep_dir": str(sweep_dir)})  # fmt: skip
            path.write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": client.tracking_uri}))
            return run.info.run_id

    def log_metrics(self, step: int, values: dict[str, float | None], prefix: str = "",
                    timestamp_ms: int | None = None) -> None:  # fmt: skip
        import time

        ts = timestamp_ms or int(time.time() * 1000)
        metrics = [Metric(f"{prefix}{k}", float(v), ts, step) for k, v in values.items()
                   if isinstance(v, int | float) and math.isfinite(v)]  # fmt: skip
        for i in range(0, len(metrics), 500):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 500])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if path.exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class MetricsFollower:
    """Forwards new lines of each process's metrics JSONL to the ledger (prefix `<process>/`).

    The byte offsets already forwarded are kept in `<run>/ledger_offsets.json`: a resumed run forwards each line
    exactly once.
    """

    def __init__(self, ledger: Ledger, processes: tuple[str, ...] = ("orchestrator", "trainer")):
        self.ledger = ledger
        self.offsets_file = ledger.run_dir / "ledger_offsets.json"
        saved = json.loads(self.offsets_file.read_text()) if self.offsets_file.exists() else {}
        self.offsets = {p: int(saved.get(p, 0)) for p in processes}

    def poll(self) -> None:
        from primerl.transport.run_dir import metrics_path

        for process, offset in self.offsets.items():
            path = metrics_path(self.ledger.run_dir, process)
            if not path.exists():
                continue
            with open(path) as f:
                f.seek(offset)
                while (line := f.readline()).endswith("\n"):
                    self.offsets[process] = f.tell()
                    try:
                        row = json.loads(line)
                    except ValueError:  # the torn last line of a process killed mid-write
                        continue
                    step, stamp = row.pop("step"), row.pop("time", None)
                    self.ledger.log_metrics(step, row, f"{process}/", int(stamp * 1000) if stamp else None)
        self.offsets_file.write_text(json.dumps(self.offsets))


def finish_sweep(sweep_dir: Path) -> None:
    """Mark a sweep's parent run FINISHED when every child finished, else FAILED (no-op without a parent)."""
    path = sweep_dir / PARENT_FILE
    if not path.exists():
        return
    parent = json.loads(path.read_text())
    client = MlflowClient(parent["tracking_uri"])
    run = client.get_run(parent["run_id"])
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    ok = bool(children) and all(child.info.status == "FINISHED" for child in children)
    client.set_terminated(run.info.run_id, status="FINISHED" if ok else "FAILED")
