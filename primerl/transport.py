"""Data that crosses process boundaries, defined once: orchestrator -> trainer batches, trainer -> inference weights.

A rollout batch for trainer step n is one safetensors file `<run>/rollouts/step_<n>.safetensors` (tensors named
`mb<i>.<field>`, JSON metadata), written to a temporary name and renamed, so a reader sees nothing or all of it.
Weights for policy version v are the HF directory `<run>/weights/step_<v>` (primerl.trainer.weights), complete
iff it holds the STABLE marker. Policy version v = the weights after v trainer steps; version 0 is the start.
No pickles anywhere: safetensors and JSON only.
"""

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MICRO_BATCH_FIELDS = ("input_ids", "position_ids", "loss_mask", "inference_logprobs", "advantages")


@dataclass
class Sample:
    """One trainable token sequence from one rollout branch (prompt, completions and env turns)."""

    token_ids: list[int]
    sampled_mask: list[bool]  # True where the policy sampled the token: the only tokens with loss
    logprobs: list[float]  # inference logprob of each token (0.0 where not sampled)
    reward: float
    advantage: float
    policy_version: int
    task_key: str = ""


@dataclass
class RolloutBatch:
    step: int
    micro_batches: list[dict[str, torch.Tensor]]  # each: MICRO_BATCH_FIELDS -> [rows, seq_len]
    num_samples: int
    num_loss_tokens: int  # over all micro-batches: the token-level normaliser of the loss
    min_policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    data_position: int = 0  # tasks the orchestrator has consumed through this batch: where a resume goes on


def rollout_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step:06d}.safetensors"


def weights_path(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "weights" / f"step_{version:06d}"


def write_rollout_batch(run_dir: str | Path, batch: RolloutBatch) -> Path:
    target = rollout_path(run_dir, batch.step)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"mb{i}.{k}": v.contiguous() for i, mb in enumerate(batch.micro_batches) for k, v in mb.items()}
    meta = {k: v for k, v in asdict(batch).items() if k != "micro_batches"}
    meta["num_micro_batches"] = len(batch.micro_batches)
    fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"primerl": json.dumps(meta)})
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def read_rollout_batch(path: str | Path) -> RolloutBatch:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["primerl"])
        micro = [
            {k: f.get_tensor(f"mb{i}.{k}") for k in MICRO_BATCH_FIELDS} for i in range(meta.pop("num_micro_batches"))
        ]
    return RolloutBatch(micro_batches=micro, **meta)


def latest_stable_version(run_dir: str | Path) -> int | None:
    """The newest published policy version (a weights directory with the STABLE marker), if any."""
    from primerl.trainer.weights import latest_stable

    return latest_stable(Path(run_dir) / "weights")
