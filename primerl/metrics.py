"""Append-only JSONL metrics, one line per step, written by each process and read by the launcher and ledger."""

import json
import math
import time
from pathlib import Path


def metrics_path(run_dir: str | Path, process: str) -> Path:
    return Path(run_dir) / "metrics" / f"{process}.jsonl"


def append_metrics(run_dir: str | Path, process: str, step: int, values: dict[str, float]) -> None:
    path = metrics_path(run_dir, process)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: (v if isinstance(v, int | float) and math.isfinite(v) else None) for k, v in values.items()}
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        f.flush()


def read_metrics(run_dir: str | Path, process: str) -> list[dict]:
    path = metrics_path(run_dir, process)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return rows
