"""`python -m primerl.train +experiment=NAME`: the whole RL run from one command.

SFT warm-start when enabled and not yet cached, then inference + orchestrator + trainer, placed by the
`launcher` group (local processes, or SLURM jobs). The run directory holds the resolved config (.hydra/),
logs/, metrics/, rollouts/ and weights/. The driver itself: primerl.launch.driver.
"""

from omegaconf import DictConfig

from primerl.app import hydra_app, to_run_config
from primerl.launch.driver import drive


@hydra_app()
def main(dict_cfg: DictConfig) -> float | None:
    return drive(to_run_config(dict_cfg), dict_cfg)


if __name__ == "__main__":
    main()
