"""The run loop every launcher shares: SFT warm-start if needed, start the topology, watch it, stop it.

A launcher places the processes (local children, SLURM jobs); this loop does the rest the same way for all of them:
progress (primerl.launch.progress), the ledger (metrics as they appear, artifacts at the end, whatever happened),
and stopping everything on the first failure, on Ctrl-C or on SIGTERM.
"""

import functools
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from primerl.config.schema import RunConfig
from primerl.launch.progress import Progress
from primerl.transport.run_dir import sft_metrics_path, sft_run_dir
from primerl.utils.locks import locked
from primerl.utils.log import get_logger

log = get_logger("train")

if TYPE_CHECKING:
    from primerl.ledger.follower import FollowerThread
    from primerl.ledger.mlflow_ledger import Ledger
    from primerl.ledger.wandb_tracker import WandbTracker


class Launcher(Protocol):
    poll_s: float

    def run_sft(self, overrides: list[str]) -> None:
        """Run the SFT warm-start to the end; raise ChildFailed if it fails."""

    def start(self, overrides: list[str]) -> None:
        """Start inference, orchestrator and trainer."""

    def finished(self) -> bool:
        """True once trainer and orchestrator ended well; raise ChildFailed as soon as any process ended badly."""

    def stop_all(self) -> None:
        """Stop whatever still runs (idempotent)."""


def sft_needed(cfg: RunConfig) -> bool:
    from primerl.launch.start import sft_applies
    from primerl.sft.cache import sft_checkpoint_dir
    from primerl.transport.atomic import is_stable

    if not cfg.sft.enabled:
        return False
    if not sft_applies(cfg):
        env = "a mixture" if cfg.mixture else f"env.id={cfg.env.id}"
        log.warning(
            f"no SFT warm-start: no demonstrations for {env} (its package has no `demonstrations` hook; "
            "give yours with sft.data=FILE.jsonl); RL starts from the base model"
        )
        return False
    target = sft_checkpoint_dir(cfg)
    if is_stable(target):
        log.info(f"SFT warm-start found at {target}")
        return False
    steps = (
        f"at most {cfg.sft.steps} steps, to sft.stop_loss={cfg.sft.stop_loss}"
        if cfg.sft.stop_loss
        else f"{cfg.sft.steps} steps"
    )
    log.info(f"SFT warm-start ({steps}) -> {target}")
    return True


def run_topology(
    cfg: RunConfig,
    overrides: list[str],
    launcher: Launcher,
    ledger: "Ledger | None" = None,
    wandb: "WandbTracker | None" = None,
) -> None:
    """Run the topology to its end; `ledger` (MLflow) and `wandb` record it as it goes."""
    from primerl.launch.start import record_start_model
    from primerl.ledger.follower import FollowerThread, MetricsFollower

    run_dir = Path(cfg.output_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # Ctrl-C and SIGTERM both stop the run, even when started with SIGINT ignored (a background job of a shell)
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    trackers = [tracker for tracker in (ledger, wandb) if tracker is not None]
    follower = MetricsFollower(run_dir, trackers, cfg.ledger.sample_every) if trackers else None
    recorder = FollowerThread(follower, launcher.poll_s) if follower else None
    progress, finished = Progress(run_dir, cfg), False
    try:
        warm_start(cfg, overrides, launcher, trackers, run_dir)
        record_start_model(cfg)  # the processes read it back instead of importing the env to decide it again
        launcher.start(overrides)
        progress.topology_starting()
        log.info(f"run directory {run_dir} (logs in {run_dir / 'logs'})")
        if recorder:
            recorder.start()
        while not launcher.finished():
            progress.poll()
            time.sleep(launcher.poll_s)
        progress.poll()
        finished = True
    finally:
        launcher.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        close_records(cfg, run_dir, recorder, ledger)
    if finished:
        progress.summary(ledger, wandb)


def warm_start(cfg: RunConfig, overrides: list[str], launcher: Launcher, trackers: list, run_dir: Path) -> None:
    """The SFT warm-start when it is needed, and its results in the run's records."""
    from primerl.sft.cache import sft_checkpoint_dir

    # sweep jobs with one SFT cache key take turns: the first trains it, the others find it STABLE and reuse it
    target = sft_checkpoint_dir(cfg)
    with locked(target, f"waiting for another run's SFT warm-start into {target}"):
        if sft_needed(cfg):
            # the train run's records hold the SFT results; the SFT process keeps none of its own
            launcher.run_sft([*overrides, "ledger.enabled=false"])
    if not trackers:  # nothing to record (and MLflow's import, ~1.3 s on 2 cores, stays out of the servers' way)
        return
    from primerl.ledger.record import record_sft

    results = sft_metrics_path(sft_run_dir(run_dir))
    for tracker in trackers:
        bookkeeping("recording the SFT results", functools.partial(record_sft, tracker, results))


def close_records(cfg: RunConfig, run_dir: Path, recorder: "FollowerThread | None", ledger: "Ledger | None") -> None:
    """Whatever happened: the reward curve, the rows not yet recorded, the end-of-run artifacts."""
    from primerl.ledger.record import record_artifacts
    from primerl.plot import reward_plot

    bookkeeping("drawing the reward curve", lambda: reward_plot(run_dir, f"{cfg.name}: mean reward per step"))
    if recorder is not None and not recorder.close():
        log.warning("the run's record misses rows it could not take; the run's files have them all")
    if ledger is not None:
        bookkeeping("recording the run's artifacts", lambda: record_artifacts(ledger, cfg.ledger, cfg.model, run_dir))


def bookkeeping(what: str, action: Callable[[], object]) -> None:
    """Run `action`; a failure is logged, never the run's: bookkeeping does not stop or fail a run."""
    try:
        action()
    except Exception as err:  # noqa: BLE001 - a locked store, a server down, a full disk, a plotting error
        log.warning(
            f"{what} failed ({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}); "
            "the run's files keep everything"
        )
