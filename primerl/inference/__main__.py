"""`python -m primerl.inference`: serve the run's policy with vLLM until stopped (Ctrl-C / SIGTERM).

Reads the `inference` and `model` groups. Serves the SFT warm-start checkpoint when `sft.enabled` and it exists,
else the base model; with LoRA, the base model and the run's start adapter (primerl.model.start). Prints the base URL once ready. `inference.replicas` servers start side by side.

A server that exits while serving (a crash, an OOM kill) is started again (the pool policy of primerl.utils.pool);
the others keep serving meanwhile, and the orchestrator takes the restarted one back with the current policy
(primerl.orchestrator.watcher). MAX_RESTARTS starts in a row that do not bring it back to serving end this process
with code 1.
"""

import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from primerl.config.cli import hydra_app, to_run_config
from primerl.config.gpus import plan_gpus, visible_gpus
from primerl.inference.pd_router import start_router
from primerl.inference.server import InferenceStartError, VllmServer, start_side_by_side, stop_side_by_side
from primerl.inference.vllm_args import check_supported, render_specs, resolve_device
from primerl.model.start import prepare_start_adapter, prepare_start_model
from primerl.transport.run_dir import log_path, pd_kv_store, scratch_prefix
from primerl.utils.errors import ConfigError, RunError
from primerl.utils.log import get_logger
from primerl.utils.pool import HEALTH_EVERY_S, RestartBudget

log = get_logger("inference")
MAX_RESTARTS = 3


def keep_serving(servers: list[VllmServer], startup_timeout_s: float) -> None:
    """Restart each server that exits, until this process is stopped; raises RunError when one cannot come back."""
    budgets = [RestartBudget(f"the vLLM server at {server.base_url}", MAX_RESTARTS) for server in servers]
    while True:
        for server, budget in zip(servers, budgets, strict=True):
            if server.process.poll() is not None:
                log.warning(
                    f"the vLLM server at {server.base_url} exited with code {server.process.returncode}; restarting "
                    f"it ({budget.failed_in_a_row + 1}/{MAX_RESTARTS}); last lines of its log:\n{server.log_tail(10)}"
                )
                restart(server, budget, startup_timeout_s)
        time.sleep(HEALTH_EVERY_S)


def restart(server: VllmServer, budget: RestartBudget, startup_timeout_s: float) -> None:
    while True:
        server.stop()  # what is left of its process group and its temp dir
        try:
            server.start(startup_timeout_s)
        except InferenceStartError as err:
            budget.failed(str(err).splitlines()[0])
            log.warning(f"{err}; starting it again ({budget.failed_in_a_row + 1}/{MAX_RESTARTS})")
            continue
        budget.served()
        log.info(f"serving at {server.base_url} again")
        return


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    device = resolve_device(cfg.inference)
    check_supported(cfg.inference, device)
    model_path = prepare_start_model(cfg)
    if not Path(model_path).exists() and cfg.model.source.value != "hub":
        raise ConfigError(
            "sft.enabled",
            f"the SFT checkpoint {model_path} does not exist yet; run "
            "`python -m primerl.sft` with the same config first, or set sft.enabled=false",
        )
    node = os.environ.get("SLURMD_NODENAME")  # SLURM: inference jobs on several nodes may pick the same port
    specs = render_specs(cfg, model_path, device, prepare_start_adapter(cfg))
    if node is None and not cfg.inference.pd.enabled:  # locally, each replica on its own GPU (primerl.config.gpus)
        gpus = plan_gpus(cfg.launcher, cfg.inference, visible_gpus())
        for replica, spec in enumerate(specs):
            spec.env |= gpus.replica_env(replica)
    servers = []
    for spec in specs:
        name = f"vllm-{node}-{spec.port}" if node else f"vllm-{spec.port}"
        servers.append(VllmServer(spec, log_path(cfg.output_dir, name), scratch_prefix(cfg.output_dir, "vllm")))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        start_side_by_side(servers, cfg.inference.startup_timeout_s)
        for server in servers:
            log.info(f"serving {model_path} at {server.base_url}")
        if cfg.inference.pd.enabled:
            inf, (prefill, decode) = cfg.inference, servers
            start_router(
                inf.host, inf.port, prefill.base_url, decode.base_url, pd_kv_store(cfg.output_dir), prefill.spec.env
            )
            log.info(
                f"prefill at {prefill.base_url}, decode at {decode.base_url}, routed at http://{inf.host}:{inf.port}"
            )
        keep_serving(servers, cfg.inference.startup_timeout_s)
    except (InferenceStartError, RunError) as err:
        log.error(str(err))
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM (the driver's death) must not cut the stop
        stop_side_by_side(servers)


if __name__ == "__main__":
    main()
