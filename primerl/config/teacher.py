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
    # the teacher's vLLM server, started by the inference process beside the policy's; None: the port after the
    # replicas' (inference.port + inference.replicas)
    port: int | None = bounded(None, ge=1, le=65535)


def teacher_port(teacher: TeacherConfig, inference_port: int, replicas: int) -> int:
    return teacher.port if teacher.port is not None else inference_port + replicas
