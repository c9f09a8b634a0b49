"""Launcher group: where the processes of a run go."""

from dataclasses import dataclass


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm
    partition: str | None = None
    time_limit_min: int = 60
    trainer_gpus: int = 0
    trainer_nodes: int = 1
    trainer_tasks_per_node: int = 1
    inference_gpus: int = 0
    cpus_per_task: int = 2
