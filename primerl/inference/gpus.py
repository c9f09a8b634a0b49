"""Which GPUs each process of a local run sees (CUDA_VISIBLE_DEVICES), planned before anything starts.

Inference servers and trainer ranks get disjoint GPUs: server i the i-th inference GPU (a server per replica, or with
prefill/decode two per replica, prefill first: primerl.inference.vllm_args; with `teacher.path` the teacher's servers
last), trainer rank r the r-th
trainer GPU (torchrun's local rank indexes the trainer's list), the orchestrator none. The GPUs are
`launcher.inference_gpu_ids` / `launcher.trainer_gpu_ids` when given, else counts (`launcher.inference_gpus`,
`launcher.trainer_gpus`; 0: one per server, one per rank) taken in order from the GPUs this machine shows,
inference first. A GPU in both lists, a GPU that is not here, more GPUs than there are, or a count that does not
give each server and rank one GPU is a ConfigError naming the key. On a machine with one GPU, sharing it is an
explicit mode, `launcher.share_gpu=true`: every process sees it, and vLLM's share of its memory
(`inference.gpu_memory_utilization`) must leave the trainer at least half. SLURM places GPUs per job itself
(primerl/launch/slurm.py) and a job's servers split its GPUs (`job_server_env`); this plan is the local launcher's.
On a machine without CUDA the plan is empty.
"""

import os
from dataclasses import dataclass

from primerl.config.inference import InferenceConfig, server_count
from primerl.config.launcher import LauncherConfig
from primerl.utils.errors import ConfigError

SHARED_GPU_MAX_UTILIZATION = 0.5  # vLLM's share of a GPU it shares with the trainer


@dataclass(frozen=True)
class GpuPlan:
    inference: tuple[str, ...] = ()  # the GPU of each inference server
    trainer: tuple[str, ...] = ()  # the GPU of each local trainer rank

    def trainer_env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.trainer)} if self.trainer else {}

    def server_env(self, server: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.inference[server]} if self.inference else {}

    def orchestrator_env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ""} if self.inference or self.trainer else {}


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else every CUDA device (none without CUDA)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def plan_gpus(
    launcher: LauncherConfig, inference: InferenceConfig, visible: list[str], teacher_servers: int = 0
) -> GpuPlan:
    """`teacher_servers`: inference servers after the policy's, the teacher's (teacher.path)."""
    if not visible or inference.device == "cpu":
        return GpuPlan()
    servers, ranks = server_count(inference) + teacher_servers, launcher.trainer_tasks_per_node
    if launcher.share_gpu:
        if inference.gpu_memory_utilization > SHARED_GPU_MAX_UTILIZATION:
            raise ConfigError(
                "inference.gpu_memory_utilization",
                f"{inference.gpu_memory_utilization} leaves the trainer too little of the GPU it shares "
                f"(launcher.share_gpu): at most {SHARED_GPU_MAX_UTILIZATION}",
            )
        return GpuPlan((visible[0],) * servers, (visible[0],) * ranks)
    inference_ids = [str(g) for g in launcher.inference_gpu_ids] or visible[: launcher.inference_gpus or servers]
    rest = [gpu for gpu in visible if gpu not in inference_ids]
    trainer_ids = [str(g) for g in launcher.trainer_gpu_ids] or rest[: launcher.trainer_gpus or ranks]
    if len(visible) < 2 and not (launcher.inference_gpu_ids and launcher.trainer_gpu_ids):
        raise ConfigError(
            "launcher.share_gpu",
            f"this machine shows one GPU ({visible[0]}): launcher.share_gpu=true puts inference and trainer on it",
        )
    for key, ids in (("launcher.inference_gpu_ids", inference_ids), ("launcher.trainer_gpu_ids", trainer_ids)):
        missing = [gpu for gpu in ids if gpu not in visible]
        if missing:
            raise ConfigError(key, f"GPU(s) {', '.join(missing)} not among this machine's ({', '.join(visible)})")
    both = sorted(set(inference_ids) & set(trainer_ids))
    if both:
        raise ConfigError("launcher.trainer_gpu_ids", f"GPU(s) {', '.join(both)} would serve inference and train")
    if len(inference_ids) != servers:
        raise ConfigError(
            "launcher.inference_gpus",
            f"{len(inference_ids)} GPU(s) for {servers} inference server(s): one each ({len(visible)} GPU(s) here)",
        )
    if len(trainer_ids) != ranks:
        raise ConfigError(
            "launcher.trainer_gpus",
            f"{len(trainer_ids)} GPU(s) for {ranks} trainer rank(s) (launcher.trainer_tasks_per_node): one each "
            f"({len(visible)} GPU(s) here, {len(inference_ids)} for inference)",
        )
    return GpuPlan(tuple(inference_ids), tuple(trainer_ids))


def job_server_env(visible: list[str], servers: int, server: int) -> dict[str, str]:
    """SLURM: the GPUs of `server` (of `servers` in this job) out of the job's `visible` ones, split evenly; with fewer
    GPUs than servers, all of them (the servers share)."""
    per = len(visible) // servers
    return {"CUDA_VISIBLE_DEVICES": ",".join(visible[server * per : (server + 1) * per])} if per else {}
