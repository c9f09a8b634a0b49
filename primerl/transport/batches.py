"""Orchestrator -> trainer: the batch for trainer step n is one safetensors file, `rollout_path(run, n)`.

Tensors are named `mb<i>.<field>` (one group per micro-batch), the rest of `RolloutBatch` is JSON metadata. The file is
written atomically, so the trainer sees nothing or all of it, and read with safetensors only (no pickles).
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from primerl.transport.atomic import atomic_file
from primerl.transport.run_dir import rollout_path

MICRO_BATCH_FIELDS = ("input_ids", "position_ids", "loss_mask", "inference_logprobs", "advantages")


@dataclass
class Sample:
    """One trainable token sequence from one rollout branch (prompt, completions and env turns)."""

    token_ids: list[int]
    sampled_mask: list[bool]  # True where the policy sampled the token: the only tokens with loss
    logprobs: list[float]  # inference logprob of each token (0.0 where not sampled)
    reward: float
    advantage: float
    policy_version: int  # the oldest policy that generated any of its tokens (the version when its group started)
    task_key: str = ""
    last_policy_version: int | None = None  # the newest (a rollout may span weight updates); None: policy_version


@dataclass
class RolloutBatch:
    step: int
    micro_batches: list[dict[str, torch.Tensor]]  # each: MICRO_BATCH_FIELDS -> [rows, seq_len]
    num_samples: int
    num_loss_tokens: int  # over all micro-batches: the token-level normaliser of the loss
    min_policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    data_position: int = 0  # tasks the orchestrator has consumed through this batch: where a resume goes on


def write_rollout_batch(run_dir: str | Path, batch: RolloutBatch) -> Path:
    target = rollout_path(run_dir, batch.step)
    tensors = {f"mb{i}.{k}": v.contiguous() for i, mb in enumerate(batch.micro_batches) for k, v in mb.items()}
    meta = {k: v for k, v in asdict(batch).items() if k != "micro_batches"}
    meta["num_micro_batches"] = len(batch.micro_batches)
    with atomic_file(target) as tmp:
        save_file(tensors, tmp, metadata={"primerl": json.dumps(meta)})
    return target


def read_rollout_batch(path: str | Path) -> RolloutBatch:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["primerl"])
        micro = [
            {k: f.get_tensor(f"mb{i}.{k}") for k in MICRO_BATCH_FIELDS} for i in range(meta.pop("num_micro_batches"))
        ]
    return RolloutBatch(micro_batches=micro, **meta)
