"""The sections of the run's config the orchestrator process reads. The entry point passes the composed `RunConfig`,
which has them all (checked by tests/test_layering.py); the orchestrator's modules name only these."""

from typing import Protocol

from primerl.config.env import EnvConfig, MixtureEntry
from primerl.config.eval import EvalConfig
from primerl.config.inference import InferenceConfig
from primerl.config.launcher import LauncherConfig
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.teacher import TeacherConfig
from primerl.config.trainer import TrainerConfig
from primerl.config.weights import WeightsConfig


class OrchestratorSections(Protocol):
    """Its own settings; the envs it trains on (`env`, or the `mixture`) and evaluates on (`eval`); the servers it
    sends rollouts to (`inference`, and with SLURM how many jobs advertise them, `launcher`); the trainer's step count,
    batch layout and the weight transfer's deadline; the teacher that scores its rollouts (`teacher`); the seed and the run directory it writes batches to."""

    seed: int
    output_dir: str
    env: EnvConfig
    mixture: list[MixtureEntry]
    eval: EvalConfig
    inference: InferenceConfig
    launcher: LauncherConfig
    orchestrator: OrchestratorConfig
    trainer: TrainerConfig
    weights: WeightsConfig
    teacher: TeacherConfig
