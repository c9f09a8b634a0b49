"""Following a run's files into its records (MLflow, W&B) while the run goes on: metrics rows and sampled rollouts."""

import json
import threading
import time
from pathlib import Path
from typing import Protocol

from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER, OrchestratorMetric, TrainerMetric
from primerl.transport.atomic import write_json
from primerl.transport.run_dir import ledger_offsets_path, metrics_path, samples_path
from primerl.utils.log import get_logger

log = get_logger("train")


class Tracker(Protocol):
    """A record a run's rows go to: primerl.ledger.mlflow_ledger.Ledger, primerl.ledger.wandb_tracker.WandbTracker."""

    def log_metrics(
        self, step: int, values: dict[str, float | None], prefix: str = "", timestamp_ms: int | None = None
    ) -> None: ...

    def log_sample(self, row: dict, key: str) -> None:
        """One sampled rollout (a row of rollouts/samples.jsonl); `key` names the row for good (its byte offset in
        the file), so a record that took it already before a crash can skip it."""


# The few metrics researchers compare across runs, logged a second time in a section of their own: MLflow's run page
# lays charts out in sections named by the key up to its last "/", in ASCII order (seen in MLflow 3.17's UI), so
# "Summary" (uppercase) comes before every process's section, where the training reward sat ~15 charts down
SUMMARY_PREFIX = "Summary/"
SUMMARY = {
    (ORCHESTRATOR, OrchestratorMetric.REWARD_MEAN): "reward",
    (ORCHESTRATOR, OrchestratorMetric.TEACHER_KL): "teacher_kl",
    (TRAINER, TrainerMetric.LOSS): "loss",
    (TRAINER, TrainerMetric.MISMATCH_KL): "mismatch_kl",
    (TRAINER, TrainerMetric.ENTROPY): "entropy",
}
EVAL_REWARD = "/reward_mean"  # an online eval row's `<env id>/reward_mean` (primerl.orchestrator.online_eval)


def summary(process: str, row: dict) -> dict:
    """The SUMMARY metrics of one metrics row, by their summary name; each eval env's reward as
    `eval_reward.<env id>`."""
    found = {name: row[key] for (owner, key), name in SUMMARY.items() if owner == process and key in row}
    if process == EVAL:
        found |= {f"eval_reward.{key[: -len(EVAL_REWARD)]}": v for key, v in row.items() if key.endswith(EVAL_REWARD)}
    return found


class MetricsFollower:
    """Forwards new lines of each process's metrics JSONL to every tracker (prefix `<process>/`, and the SUMMARY ones
    again under `Summary/`), and the sampled rollouts of every `sample_every`-th step (`rollouts/samples.jsonl`).

    The byte offsets already forwarded are kept in `<run>/ledger_offsets.json` (replaced atomically, after every
    sample): a resumed run forwards each line exactly once. A driver killed between a record taking a line and the
    offset's save sends that line again: a metrics row is then the same (key, step, timestamp, value), which MLflow
    keeps once; a sample carries its offset as its key, and a record that holds it already skips it.
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
                stamp_ms, headline = int(stamp * 1000) if stamp else None, summary(process, row)
                for tracker in self.trackers:
                    tracker.log_metrics(step, row, f"{process}/", stamp_ms)
                    if headline:
                        tracker.log_metrics(step, headline, SUMMARY_PREFIX, stamp_ms)
                self.offsets[process] = offset
        self._save_offsets()
        for row, offset in self._new_rows(self.SAMPLES, samples_path(self.run_dir)):
            if row.get("step", 0) % self.sample_every == 0:
                for tracker in self.trackers:
                    tracker.log_sample(row, str(self.offsets[self.SAMPLES]))
            self.offsets[self.SAMPLES] = offset
            self._save_offsets()


class FollowerThread:
    """Runs `follower.poll()` every `every_s` on a thread of its own, so bookkeeping never blocks or stops a run: an
    error (a locked store, a tracking server that is down, a full disk) is logged, the rows wait in the run's files,
    and a later poll sends them, each once (the follower's offsets advance only past what was sent)."""

    WARN_EVERY_S = 60.0

    def __init__(self, follower: MetricsFollower, every_s: float):
        self.follower, self.every_s = follower, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-follower", daemon=True)
        self._failing_since: float | None = None
        self._warned = 0.0

    def start(self) -> "FollowerThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll_once()

    def poll_once(self) -> bool:
        """Forward what is new; False (logged) when the record could not take it now."""
        try:
            self.follower.poll()
        except Exception as err:  # noqa: BLE001 - whatever the store raises, the run goes on
            now = time.monotonic()
            if self._failing_since is None or now - self._warned >= self.WARN_EVERY_S:
                log.warning(
                    f"the run's record cannot take new rows now ({type(err).__name__}: "
                    f"{str(err).splitlines()[0][:200] if str(err) else ''}); the run goes on, and they are "
                    "sent once it can"
                )
                self._warned = now
            self._failing_since = self._failing_since or now
            return False
        if self._failing_since is not None:
            log.info(f"the run's record caught up after {time.monotonic() - self._failing_since:.0f}s")
            self._failing_since = None
        return True

    def close(self) -> bool:
        """Stop the thread, then poll once more: whether everything produced reached the record."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.poll_once()
