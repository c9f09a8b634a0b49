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
    line = (json.dumps({"step": step, "time": time.time(), **clean}) + "\n").encode()
    with open(path, "a+b") as f:
        if f.tell() > 0:  # a process killed mid-line left a torn line: start on a fresh one
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                line = b"\n" + line
        f.write(line)
        f.flush()


def append_metrics_once(run_dir: str | Path, process: str, step: int, values: dict[str, float]) -> None:
    """Append `step`'s row unless it is there: how a resumed process restores a row its predecessor died before."""
    if all(row["step"] != step for row in read_metrics(run_dir, process)):
        append_metrics(run_dir, process, step, values)


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
