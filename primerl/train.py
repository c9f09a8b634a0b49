"""`python -m primerl.train +experiment=NAME`: the whole RL run from one command.

SFT warm-start when enabled and not yet cached, then inference + orchestrator + trainer, placed by the
`launcher` group (local processes, or SLURM jobs). The run directory holds the resolved config (.hydra/),
logs/, metrics/, rollouts/ and weights/.
"""

import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from primerl.config.cli import hydra_app, to_run_config
from primerl.config.validate import ConfigError
from primerl.launch.local import ChildFailed, run_local


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("output_dir=")]
    try:
        from primerl.config.validate import resolve_dp_shard
        from primerl.envs.verifiers_env import load_env

        load_env(cfg.env)  # an unknown env id or bad env args fail here, before any process starts
        resolve_dp_shard(cfg, cfg.launcher.trainer_tasks_per_node * cfg.launcher.trainer_nodes)
        if cfg.launcher.name == "local":
            run_local(cfg, overrides)
        else:
            raise ConfigError("launcher.name", f"'{cfg.launcher.name}' is not available yet; use launcher=local")
    except ConfigError as err:
        print(f"primerl: config error: {err}", file=sys.stderr)
        sys.exit(2)
    except ChildFailed as err:
        print(f"train: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("train: interrupted; all processes stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
