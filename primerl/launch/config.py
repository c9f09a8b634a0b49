"""Launcher group: where the processes of a run go."""

from dataclasses import dataclass, field


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm
    # The trainer's ranks: trainer_nodes x trainer_tasks_per_node (local: nodes must be 1; torchrun on this machine).
    trainer_nodes: int = 1
    trainer_tasks_per_node: int = 1
    # SLURM only (primerl/launch/slurm.py): one job each for inference, orchestrator and trainer (and SFT if needed).
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit_min: int = 60
    trainer_gpus: int = 0  # per node
    inference_gpus: int = 0
    cpus_per_task: int = 2
    signal_delay_s: int = 90  # SLURM signals a job this long before its time limit: it requeues itself
    max_requeues: int = 3  # requeues after a time-out; preemptions do not count
    setup: list[str] = field(default_factory=list)  # shell lines run first in every job (module load, ...)
    poll_s: float = 5.0  # how often the driver asks SLURM for job states
