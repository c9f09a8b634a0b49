"""Teacher group: on-policy distillation (primerl.orchestrator.teacher). A teacher model scores every token the
student sampled; the per-token reverse KL, `log pi_teacher - log pi_student`, is added to each sampled token's
advantage, alone (`reward_weight=0`) or beside the reward's."""

from dataclasses import dataclass

from primerl.utils.bounds import bounded


@dataclass
class TeacherConfig:
    # a model directory (Hugging Face layout: a model primerl can serve, a run's published weights/step_N) with the
    # student's tokenizer; None: no teacher
    path: str | None = None
    coef: float = bounded(1.0, gt=0)  # weight of the per-token reverse-KL advantage
    reward_weight: float = bounded(1.0, ge=0)  # weight of the reward advantage; 0: distillation alone
    # the teacher's vLLM server(s): locally started by the inference process beside the policy's, on this port
    # (None: the port after the replicas', inference.port + inference.replicas); under launcher=slurm a job of its
    # own (`teacher`, placed by `launcher.sbatch.teacher`, `launcher.teacher_gpus` GPUs) on this port of its node
    # (None: a free one), which it advertises to the orchestrator's job
    port: int | None = bounded(None, ge=1, le=65535)
    # the teacher's servers, on consecutive ports from `port`; each branch goes to the one with the fewest requests
    # in flight, a failed request to another
    replicas: int = bounded(1, ge=1)
    # set by the SLURM launcher, not by hand: the node the teacher's job serves on (None: inference.host), and in the
    # teacher's job itself, that its inference process serves the teacher alone
    host: str | None = None
    alone: bool = False


def teacher_ports(teacher: TeacherConfig, inference_port: int, replicas: int) -> list[int]:
    """The teacher's servers' ports: from `teacher.port`, else from the port after the policy's `replicas`."""
    first = teacher.port if teacher.port is not None else inference_port + replicas
    return [first + i for i in range(teacher.replicas)]


def teacher_servers(teacher: TeacherConfig) -> int:
    """How many vLLM servers the teacher takes (0: no teacher)."""
    return teacher.replicas if teacher.path is not None else 0
