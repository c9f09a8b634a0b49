"""What the driver prints while a run goes on, read from the run's metrics files (the processes print to their logs).

- Until the first trainer step: a line every NOTE_EVERY_S naming what is starting, read from the processes' logs (vLLM
  loading or serving on its ports, the trainer building or ready, the env workers), and where the logs are (vLLM takes
  a minute or more to start on a CPU).
- One line per trainer step: reward, loss, failed rollouts, off-policy lag, generation and training time, elapsed
  time and an ETA from the mean time per step so far.
- One line per online eval (metrics/eval.jsonl).
- At the end, a summary: wall time, reward first to last, evals, the run directory and how to open its MLflow record.
"""

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.config.schema import RunConfig
from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER, OrchestratorMetric, TrainerMetric, read_metrics
from primerl.transport.run_dir import log_path, reward_plot_path, weights_path
from primerl.transport.weights import latest_stable_version
from primerl.utils.log import get_logger

if TYPE_CHECKING:
    from primerl.ledger.mlflow_ledger import Ledger
    from primerl.ledger.wandb_tracker import WandbTracker

log = get_logger("train")
NOTE_EVERY_S = 15.0
PROCESSES = ("inference", "orchestrator", "trainer")
M, T = OrchestratorMetric, TrainerMetric


def shown(value: float | None, spec: str) -> str:
    """A metric in a progress line. A non-finite value is stored as null (primerl.metrics): a step whose update was
    skipped for a NaN loss shows `nan` and the run goes on."""
    return "nan" if value is None else format(value, spec)


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class Progress:
    def __init__(self, run_dir: Path, cfg: RunConfig):
        self.run_dir, self.cfg = run_dir, cfg
        self.started = self.noted = self.topology_started = time.monotonic()
        self.steps_shown = self.evals_shown = 0
        self.first_step: int | None = None  # the first step this driver saw trained (a resumed run starts later)

    def topology_starting(self) -> None:
        """The processes are starting now (after the SFT warm-start, if any): waiting notes count from here."""
        self.noted = self.topology_started = time.monotonic()

    def poll(self) -> None:
        """Print what is new since the last poll."""
        orchestrator = {row["step"]: row for row in read_metrics(self.run_dir, ORCHESTRATOR)}
        trainer = read_metrics(self.run_dir, TRAINER)
        for row in trainer[self.steps_shown :]:
            self._step_line(row, orchestrator.get(row["step"], {}))
        self.steps_shown = len(trainer)
        evals = read_metrics(self.run_dir, EVAL)
        for row in evals[self.evals_shown :]:
            log.info(f"eval of policy v{row['step']}: {eval_summary(row)}")
        self.evals_shown = len(evals)
        if not trainer and time.monotonic() - self.noted >= NOTE_EVERY_S:
            self.noted = time.monotonic()
            log.info(f"{self._awaited(orchestrator)} ({duration(self.noted - self.topology_started)})")

    def _awaited(self, orchestrator: dict) -> str:
        if orchestrator:
            return f"training step 0 (log: {log_path(self.run_dir, 'trainer')})"
        return f"starting: {', '.join(self._phases())}; the first batch follows (logs: {self.run_dir / 'logs'})"

    def _phases(self) -> list[str]:
        """What each process is doing, from the last lines of its log."""
        inference, orchestrator, trainer = (tail(log_path(self.run_dir, p)) for p in PROCESSES)
        serving = sorted(set(re.findall(r"serving .* at \S+:(\d+)", inference)))
        loading = sorted(set(re.findall(r"still waiting for vLLM at \S+:(\d+)", inference)) - set(serving))
        phases = [f"vLLM serving on :{', :'.join(serving)}"] if serving else []
        phases += [f"vLLM loading on :{', :'.join(loading)}"] if loading else []
        phases += [] if serving or loading else ["inference starting"]
        found = re.findall(r"starting at step (\d+)", trainer)
        phases.append(f"trainer ready at step {found[-1]}" if found else "trainer building the model")
        if "env worker(s) serve" in orchestrator:
            phases.append("env workers up")
        return phases

    def _step_line(self, row: dict, orch: dict) -> None:
        step, total = row["step"], self.cfg.trainer.max_steps
        if self.first_step is None:
            self.first_step, self.first_step_at = step, time.monotonic()
        elapsed = time.monotonic() - self.started
        done_here = step - self.first_step  # steps since the first this driver saw, each timed by its wall clock
        per_step = (time.monotonic() - self.first_step_at) / done_here if done_here else None
        eta = duration(per_step * (total - step - 1)) if per_step is not None else "?"
        log.info(
            f"step {step + 1}/{total}  reward {shown(orch.get(M.REWARD_MEAN), '.3f')}"
            f"  loss {shown(row.get(T.LOSS), '+.4f')}  mismatch_kl {shown(row.get(T.MISMATCH_KL), '.1e')}"
            f"  failed {shown(orch.get(M.ROLLOUTS_FAILED), '.0f')}  lag {shown(orch.get(M.OFF_POLICY_MEAN), '.1f')}"
            f"  gen {shown(orch.get(M.GENERATE_S), '.1f')}s  train {shown(row.get(T.STEP_S), '.1f')}s"
            f"  elapsed {duration(elapsed)}  eta {eta}"
        )

    def summary(self, ledger: "Ledger | None", wandb: "WandbTracker | None" = None) -> None:
        """The run's last lines: what it did and where to look."""
        reward = [
            r[M.REWARD_MEAN] for r in read_metrics(self.run_dir, ORCHESTRATOR) if r.get(M.REWARD_MEAN) is not None
        ]
        rewards = f"reward {reward[0]:.3f} -> {reward[-1]:.3f} over {len(reward)} steps" if reward else "no reward yet"
        log.info(f"done in {duration(time.monotonic() - self.started)}: {rewards}")
        for row in read_metrics(self.run_dir, EVAL):
            log.info(f"  eval of policy v{row['step']}: {eval_summary(row)}")
        plot = reward_plot_path(self.run_dir)
        log.info(f"run directory {self.run_dir}" + (f" (reward curve: {plot})" if plot.exists() else ""))
        final = latest_stable_version(self.run_dir)
        if final is not None:
            log.info(f"final policy: {weights_path(self.run_dir, final)}")
        model = ledger.logged_model(f"policy-v{final}") if ledger is not None and final is not None else None
        if model is not None:
            log.info(f"logged model: models:/{model} (mlflow.transformers.load_model, or register it in the UI)")
        if ledger is not None and ledger.url():
            log.info(f"MLflow run: {ledger.url()}")
        elif ledger is not None:
            log.info(
                f"MLflow run {ledger.run_id}: mlflow ui --backend-store-uri {ledger.client.tracking_uri}, then open "
                "http://127.0.0.1:5000"
            )
        if wandb is not None:
            log.info(f"W&B run: {wandb.where()}")


def tail(path: Path, size: int = 16384) -> str:
    """The last `size` bytes of a log ("" when there is none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def eval_summary(row: dict) -> str:
    """`<env> reward R (pass@k P)` for each env of an eval row (keys `<env id>/reward_mean`, `<env id>/pass_at_<k>`)."""
    parts = []
    for key in sorted(k for k in row if k.endswith("/reward_mean")):
        env = key.removesuffix("/reward_mean")
        passes = sorted(k for k in row if k.startswith(f"{env}/pass_at_"))
        extra = (
            f" ({passes[-1].removeprefix(env + '/').replace('_at_', '@')} {shown(row[passes[-1]], '.3f')})"
            if passes
            else ""
        )
        parts.append(f"{env} reward {shown(row[key], '.3f')}{extra}")
    return "; ".join(parts) or "no scores"
