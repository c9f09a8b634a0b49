"""`python -m primerl.inference`: serve the run's policy with vLLM until stopped (Ctrl-C / SIGTERM).

Reads the `inference` and `model` groups. Serves the SFT warm-start checkpoint when `sft.enabled` and it exists,
else the base model. Prints the base URL once ready. `inference.replicas` servers start side by side.

A server that exits while serving (a crash, an OOM kill) is started again, at most MAX_RESTARTS times each; the
others keep serving meanwhile, and the orchestrator takes the restarted one back with the current policy
(primerl.orchestrator.watcher). One more exit ends this process with code 1.
"""

import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from primerl.config.cli import hydra_app, to_run_config
from primerl.inference.server import (
    InferenceStartError,
    VllmServer,
    check_supported,
    render_specs,
    resolve_device,
)
from primerl.model.start import prepare_start_model
from primerl.transport.run_dir import log_path, vllm_scratch_prefix
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger

log = get_logger("inference")
MAX_RESTARTS = 3


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
    servers = []
    for spec in render_specs(cfg, model_path, device):
        name = f"vllm-{node}-{spec.port}" if node else f"vllm-{spec.port}"
        servers.append(VllmServer(spec, log_path(cfg.output_dir, name), vllm_scratch_prefix(cfg.output_dir)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_ready(cfg.inference.startup_timeout_s)
            log.info(f"serving {model_path} at {server.base_url}")
        restarts = [0] * len(servers)
        while True:
            for index, server in enumerate(servers):
                if server.process.poll() is None:
                    continue
                if restarts[index] == MAX_RESTARTS:
                    log.error(f"the vLLM server at {server.base_url} exited again after {MAX_RESTARTS} restarts")
                    sys.exit(1)
                restarts[index] += 1
                log.warning(
                    f"the vLLM server at {server.base_url} exited with code {server.process.returncode}; "
                    f"restarting it ({restarts[index]}/{MAX_RESTARTS}); last lines of its log:\n"
                    f"{server.log_tail(10)}"
                )
                server.stop()  # what is left of its process group and its temp dir
                server.start(cfg.inference.startup_timeout_s)
                log.info(f"serving {model_path} at {server.base_url} again")
            time.sleep(1.0)
    except InferenceStartError as err:
        log.error(str(err))
        sys.exit(1)
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
