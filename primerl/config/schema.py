"""The root schema: one typed dataclass per config group, registered in Hydra's ConfigStore.

`primerl/conf/config.yaml` lists `primerl_schema` first in its defaults, so every group file merges into a typed node:
an unknown key or a value of the wrong type fails at composition, before any process starts.
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from primerl.config.env import EnvConfig, MixtureEntry
from primerl.config.eval import EvalConfig
from primerl.config.inference import InferenceConfig
from primerl.config.launcher import ForkConfig, LauncherConfig
from primerl.config.ledger import LedgerConfig
from primerl.config.model import ModelConfig
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.sft import SftConfig
from primerl.config.teacher import TeacherConfig
from primerl.config.trainer import ParallelismConfig, TrainerConfig
from primerl.config.weights import WeightsConfig


@dataclass
class RunConfig:
    name: str = "default"
    seed: int = 0
    output_dir: str = "${hydra:runtime.output_dir}"
    cache_dir: str = "${oc.env:PRIMERL_CACHE,${oc.env:HOME}/.cache/primerl}"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    # several training envs, each task drawn from one of them by weight (primerl.envs.mixture); empty: `env` alone
    mixture: list[MixtureEntry] = field(default_factory=list)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)  # trainer -> inference (primerl.transport)
    sft: SftConfig = field(default_factory=SftConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation
    eval: EvalConfig = field(default_factory=EvalConfig)  # primerl eval
    fork: ForkConfig = field(default_factory=ForkConfig)  # start from another run's checkpoint
    # settings a resumed run may change although it was started with others (primerl.launch.resume), e.g.
    # [trainer.optim.lr]; a key names itself and everything below it
    allow_changes: list[str] = field(default_factory=list)


def register_schema() -> None:
    ConfigStore.instance().store(name="primerl_schema", node=RunConfig)
