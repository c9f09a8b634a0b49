"""Sweeps in the ledger: a parent MLflow run per Hydra sweep directory (recorded in `<sweep>/ledger_parent.json`),
each job's run its child; the parent is marked FINISHED when every child finished (primerl.ledger.sweep_callback)."""

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from primerl.transport.atomic import write_json
from primerl.utils.locks import locked

PARENT_FILE = "ledger_parent.json"


def sweep_parent(client: MlflowClient, experiment: str, sweep_dir: Path) -> str:
    """The sweep's parent run (created by the first job to get here, under a file lock); each job is its child."""
    path = sweep_dir / PARENT_FILE
    with locked(path):
        if path.exists():
            return json.loads(path.read_text())["run_id"]
        run = client.create_run(
            experiment,
            run_name=f"sweep-{sweep_dir.name}",
            tags={"primerl.kind": "sweep", "primerl.sweep_dir": str(sweep_dir)},
        )
        write_json(path, {"run_id": run.info.run_id, "tracking_uri": client.tracking_uri})
        return run.info.run_id


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
