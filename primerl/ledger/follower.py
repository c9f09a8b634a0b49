"""Following a run's files into its records (MLflow, W&B) while the run goes on: metrics rows and sampled rollouts."""

import json
from pathlib import Path
from typing import Protocol

from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER
from primerl.transport.atomic import write_json
from primerl.transport.run_dir import ledger_offsets_path, metrics_path, samples_path


class Tracker(Protocol):
    """A record a run's rows go to: primerl.ledger.mlflow_ledger.Ledger, primerl.ledger.wandb_tracker.WandbTracker."""

    def log_metrics(
        self, step: int, values: dict[str, float | None], prefix: str = "", timestamp_ms: int | None = None
    ) -> None: ...

    def log_sample(self, row: dict) -> None:
        """One sampled rollout (a row of rollouts/samples.jsonl)."""


class MetricsFollower:
    """Forwards new lines of each process's metrics JSONL to every tracker (prefix `<process>/`), and the sampled
    rollouts of every `sample_every`-th step (`rollouts/samples.jsonl`).

    The byte offsets already forwarded are kept in `<run>/ledger_offsets.json` (replaced atomically, after every
    sample): a resumed run forwards each line exactly once.
    """

    SAMPLES = "samples"

    def __init__(
        self,
        run_dir: Path,
        trackers: list[Tracker],
        sample_every: int = 1,
        processes: tuple[str, ...] = (ORCHESTRATOR, TRAINER, EVAL),
    ):
        self.run_dir, self.trackers = Path(run_dir), trackers
        self.sample_every = sample_every
        self.offsets_file = ledger_offsets_path(run_dir)
        saved = json.loads(self.offsets_file.read_text()) if self.offsets_file.exists() else {}
        self.offsets = {p: int(saved.get(p, 0)) for p in (*processes, self.SAMPLES)}

    def _save_offsets(self) -> None:
        write_json(self.offsets_file, self.offsets)

    def _new_rows(self, name: str, path: Path):
        """(row, offset after it) for each complete new JSON line of `path` past the saved offset."""
        if not path.exists():
            return
        with open(path) as f:
            f.seek(self.offsets[name])
            while (line := f.readline()).endswith("\n"):
                try:
                    row = json.loads(line)
                except ValueError:  # the torn last line of a process killed mid-write
                    self.offsets[name] = f.tell()
                    continue
                yield row, f.tell()

    def poll(self) -> None:
        for process in sorted(self.offsets.keys() - {self.SAMPLES}):
            for row, offset in self._new_rows(process, metrics_path(self.run_dir, process)):
                step, stamp = row.pop("step"), row.pop("time", None)
                for tracker in self.trackers:
                    tracker.log_metrics(step, row, f"{process}/", int(stamp * 1000) if stamp else None)
                self.offsets[process] = offset
        self._save_offsets()
        for row, offset in self._new_rows(self.SAMPLES, samples_path(self.run_dir)):
            if row.get("step", 0) % self.sample_every == 0:
                for tracker in self.trackers:
                    tracker.log_sample(row)
            self.offsets[self.SAMPLES] = offset
            self._save_offsets()
