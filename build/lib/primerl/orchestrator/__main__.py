"""`python -m primerl.orchestrator`: continuous rollouts -> packed batches for the trainer; new policies -> vLLM.

The components and their invariants are in primerl/orchestrator/loop.py; the wiring in orchestrator.py.
"""

import asyncio

from omegaconf import DictConfig

from primerl.config.cli import hydra_app, to_run_config
from primerl.orchestrator.orchestrator import run_orchestrator


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    asyncio.run(run_orchestrator(to_run_config(dict_cfg)))


if __name__ == "__main__":
    main()
