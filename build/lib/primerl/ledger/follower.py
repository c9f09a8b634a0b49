"""Following a run's files into its MLflow record while the run goes on: metrics rows and sampled rollouts."""

import json
from pathlib import Path

from primerl.ledger.mlflow_ledger import Ledger
from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER
from primerl.transport.atomic import write_json
from primerl.transport.run_dir import ledger_offsets_path, metrics_path, samples_path


class MetricsFollower:
    """Forwards new lines of each process's metrics JSONL to the ledger (prefix `<process>/`), and the sampled
    rollouts of every `sample_every`-th step (`rollouts/samples.jsonl`) as MLflow traces (primerl.ledger.mlflow_traces).

    The byte offsets already forwarded are kept in `<run>/ledger_offsets.json` (replaced atomically, after every
    trace): a resumed run forwards each line exactly once.
    """

    SAMPLES = "samples"

    def __init__(
        self, ledger: Ledger, processes: tuple[str, ...] = (ORCHESTRATOR, TRAINER, EVAL), sample_every: int = 1
    ):
        self.ledger = ledger
        self.sample_every = sample_every
        self.offsets_file = ledger_offsets_path(ledger.run_dir)
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
        for process in self.offsets.keys() - {self.SAMPLES}:
            for row, offset in self._new_rows(process, metrics_path(self.ledger.run_dir, process)):
                step, stamp = row.pop("step"), row.pop("time", None)
                self.ledger.log_metrics(step, row, f"{process}/", int(stamp * 1000) if stamp else None)
                self.offsets[process] = offset
        self._save_offsets()
        for row, offset in self._new_rows(self.SAMPLES, samples_path(self.ledger.run_dir)):
            if row.get("step", 0) % self.sample_every == 0:
                from primerl.ledger.mlflow_traces import log_rollout_trace

                log_rollout_trace(self.ledger.client, self.ledger.run_id, self.ledger.experiment_id, row)
            self.offsets[self.SAMPLES] = offset
            self._save_offsets()
