"""Orchestrator -> trainer: the batch for trainer step n is one safetensors file, `rollout_path(run, n)`.

Tensors are named `mb<i>.<field>` (one group per micro-batch), the rest of `RolloutBatch` is JSON metadata. The file is
written atomically, so the trainer sees nothing or all of it, and read with safetensors only (no pickles). The metadata
records the data's size and a sha256 over the metadata and the data: a file damaged or altered after it was written
(truncated, bytes or header fields changed) is refused with `CorruptBatch`, never trained.
"""

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from primerl.transport.atomic import atomic_file
from primerl.transport.run_dir import rollout_path
from primerl.utils.errors import RunError

MICRO_BATCH_FIELDS = ("input_ids", "position_ids", "loss_mask", "inference_logprobs", "advantages")
# present only when the batch carries them: the experts the engine routed each token to in each MoE layer,
# [rows, seq_len, moe_layers, k], NO_ROUTE where none (primerl/trainer/routing_replay.py)
ROUTES_FIELD, NO_ROUTE = "routed_experts", -1
OPTIONAL_MICRO_BATCH_FIELDS = (ROUTES_FIELD,)
SAMPLING_FIELDS = ("temperature", "async_level")


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
    # added to `advantage` token by token (on-policy distillation's reverse KL, 0.0 where not sampled); None: nothing
    token_advantages: list[float] | None = None
    # the experts the engine routed each token to, [len(token_ids), moe_layers, k]; None: not returned
    routed_experts: np.ndarray | None = None


@dataclass
class RolloutBatch:
    step: int
    micro_batches: list[dict[str, torch.Tensor]]  # each: MICRO_BATCH_FIELDS -> [rows, seq_len]
    num_samples: int
    num_loss_tokens: int  # over all micro-batches: the token-level normaliser of the loss
    min_policy_version: int
    # how the samples were drawn, which the loss must match: the trainer reads these from the batch, never from the
    # orchestrator's config
    temperature: float
    async_level: int  # the most policy versions a sample may lag (primerl.transport.weights.versions_to_keep)
    metrics: dict[str, float] = field(default_factory=dict)
    data_position: int = 0  # tasks the orchestrator has drawn through this batch: where a resume goes on
    # task indices (primerl.orchestrator.accounting): first trained in this batch, ended untrained since the previous
    # batch, and drawn but neither at this cut (a resume runs them again first); absent from older batches
    tasks_trained: list[int] = field(default_factory=list)
    tasks_spent: list[int] = field(default_factory=list)
    tasks_pending: list[int] = field(default_factory=list)


class CorruptBatch(RunError):
    def __init__(self, path: Path, why: str):
        super().__init__(
            f"rollout batch {path} is corrupt ({why}); move it and every later batch aside and rerun: "
            "the orchestrator writes them again"
        )


def _digest(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[str, int]:
    """sha256 of the metadata (as canonical JSON) and of the tensors' names and data in name order; the data's byte
    count."""
    h, size = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()), 0
    for name in sorted(tensors):
        data = tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        h.update(name.encode())
        h.update(data)
        size += len(data)
    return h.hexdigest(), size


def write_rollout_batch(run_dir: str | Path, batch: RolloutBatch) -> Path:
    target = rollout_path(run_dir, batch.step)
    tensors = {f"mb{i}.{k}": v.contiguous() for i, mb in enumerate(batch.micro_batches) for k, v in mb.items()}
    meta = {k: v for k, v in asdict(batch).items() if k != "micro_batches"}
    meta["num_micro_batches"] = len(batch.micro_batches)
    meta["sha256"], meta["data_bytes"] = _digest(tensors, meta)
    data = save(tensors, metadata={"primerl": json.dumps(meta)})  # bytes: a full disk is Python's OSError (ENOSPC)
    with atomic_file(target) as tmp:
        tmp.write_bytes(data)
    return target


def read_rollout_batch(path: str | Path) -> RolloutBatch:
    """The batch, after checking the file's size and its data's sha256 against its metadata (`CorruptBatch` if not)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header_bytes = struct.unpack("<Q", f.read(8))[0]
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["primerl"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - whatever safetensors or JSON raise on a damaged file
        raise CorruptBatch(path, f"unreadable: {type(err).__name__}: {str(err).splitlines()[0][:200]}") from err
    expected, size = meta.pop("sha256", None), meta.pop("data_bytes", None)
    if size is not None and path.stat().st_size != 8 + header_bytes + size:
        raise CorruptBatch(path, f"{path.stat().st_size} bytes, {8 + header_bytes + size} expected")
    missing = [key for key in SAMPLING_FIELDS if key not in meta]
    if missing:
        raise RunError(
            f"rollout batch {path} records no {' or '.join(missing)} (written by an older primerl): "
            "start a new run, or move it and every later batch aside so the orchestrator writes them again"
        )
    if expected is None or _digest(tensors, meta)[0] != expected:
        raise CorruptBatch(path, "its data or metadata does not match its recorded sha256")
    micro = [
        {k: tensors[f"mb{i}.{k}"] for k in MICRO_BATCH_FIELDS}
        | {k: tensors[f"mb{i}.{k}"] for k in OPTIONAL_MICRO_BATCH_FIELDS if f"mb{i}.{k}" in tensors}
        for i in range(meta.pop("num_micro_batches"))
    ]
    return RolloutBatch(micro_batches=micro, **meta)
