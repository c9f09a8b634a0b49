"""Launcher group: where the processes of a run go."""

from dataclasses import dataclass, field
from typing import Any

from primerl.utils.bounds import bounded

# The roles of a run's SLURM jobs (primerl/launch/slurm.py names inference jobs after the first `inference-<j>`; with
# prefill/decode each inference job is a `prefill` and a `decode` job; `teacher` with teacher.path); the keys
# `launcher.sbatch` accepts.
JOB_ROLES = ("trainer", "inference", "prefill", "decode", "orchestrator", "sft", "teacher")


def job_role(job_name: str) -> str:
    return job_name.split("-")[0]


@dataclass
class LauncherConfig:
    name: str = "local"  # local | slurm
    # The trainer's ranks: trainer_nodes x trainer_tasks_per_node (local: nodes must be 1; torchrun on this machine).
    trainer_nodes: int = bounded(1, ge=1)
    trainer_tasks_per_node: int = bounded(1, ge=1)
    # local: OMP/torch threads per trainer rank. None: on CPU the cores vLLM does not pin (cores - 1), on GPU torch's
    # default. benchmarks/step_profile.py measures the trade: more threads, more contention with vLLM.
    trainer_threads: int | None = bounded(None, ge=1)
    # local, CPU: generation and training take turns (orchestrator.async_level=0, so they never run at once) and the
    # trainer gets every core instead of every core but the one vLLM's model runs on. The server keeps its cores:
    # while it generates, its API server and the orchestrator need the other one (given both, it generated 0.91x as
    # fast: benchmarks/results.md). Pays where training dominates a step, not at the default size (docs/scaling.md)
    colocate: bool = False
    # SLURM only (primerl/launch/slurm.py): one job each for inference, orchestrator and trainer (and SFT if needed).
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit_min: int = bounded(60, ge=1)
    # GPUs (SLURM: per trainer node and per inference job, with PD per prefill and per decode job; local: of this
    # machine, 0: one per rank and per inference server)
    trainer_gpus: int = bounded(0, ge=0)
    inference_gpus: int = bounded(0, ge=0)
    teacher_gpus: int = bounded(0, ge=0)  # SLURM: of the teacher's job (teacher.path); local: see inference_gpus
    # local: which GPUs, by CUDA id (instead of counts); inference and trainer must not share one ...
    inference_gpu_ids: list[str] = field(default_factory=list)
    trainer_gpu_ids: list[str] = field(default_factory=list)
    # ... unless this is set: on a one-GPU machine every process uses GPU 0, vLLM bounded to half its memory
    # (primerl/inference/gpus.py)
    share_gpu: bool = False
    # the inference.replicas are served by this many jobs, on any nodes, inference.replicas / inference_jobs each
    inference_jobs: int = bounded(1, ge=1)
    cpus_per_task: int = bounded(2, ge=1)
    signal_delay_s: int = bounded(90, ge=0)  # SLURM signals a job this long before its time limit: it requeues itself
    max_requeues: int = bounded(3, ge=0)  # requeues after a time-out; preemptions do not count
    # a job whose driver has not renewed its lease this long (a driver killed with -9) stops by itself
    driver_lease_s: float = bounded(300.0, ge=30)
    # more sbatch options per job role (trainer, inference, prefill, decode, orchestrator, sft, teacher), as
    # `--key=value` (`true`: a bare flag): placement on a real cluster, e.g.
    # `+launcher.sbatch.inference.constraint=infer`, `...trainer.exclusive=true`,
    # `'+launcher.sbatch.trainer.exclude="node3"'`. Every inference job of a run (every
    # prefill job, every decode job) gets the same options.
    sbatch: dict[str, dict[str, Any]] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)  # shell lines run first in every job (module load, ...)
    poll_s: float = bounded(5.0, gt=0)  # how often the driver asks SLURM for job states


@dataclass
class ForkConfig:
    """A run that starts from another run's checkpoint (primerl.launch.fork): `fork.run=DIR` the parent's run
    directory, `fork.step` its checkpoint (None: the newest STABLE one), `weights_only` leaves the optimizer state
    fresh."""

    run: str | None = None
    step: int | None = bounded(None, ge=1)
    weights_only: bool = False
