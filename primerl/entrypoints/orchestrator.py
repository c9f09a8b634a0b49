"""`primerl orchestrator`: continuous rollouts -> packed batches for the trainer; new policies -> vLLM.

The components and their invariants are in primerl/orchestrator/loop.py; the wiring in orchestrator.py.
"""

import asyncio

from omegaconf import DictConfig

from primerl.app import hydra_app, to_run_config
from primerl.launch.start import prepare_start_model
from primerl.metrics import ORCHESTRATOR, serve_live_metrics
from primerl.orchestrator.orchestrator import run_orchestrator
from primerl.utils.process import raise_open_files_limit


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    raise_open_files_limit()  # a connection per replica in a weight load's fan-out
    serve_live_metrics(cfg.ledger.prometheus, ORCHESTRATOR, cfg.output_dir, cfg.name, cfg.inference.api_key)
    asyncio.run(run_orchestrator(cfg, prepare_start_model(cfg)))


if __name__ == "__main__":
    main()
