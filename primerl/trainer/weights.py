"""Hugging Face safetensors checkpoints of a model being trained, published atomically (primerl.transport.atomic):
a directory is complete iff it holds the STABLE marker, so a crash half-way leaves nothing a reader would load.
"""

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from primerl.transport.atomic import atomic_dir, write_json
from primerl.transport.fingerprint import fingerprint_of
from primerl.transport.offer import TensorSpec, spec_of
from primerl.transport.weights import FINGERPRINT_FILE

_COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def full_state_dict(model: torch.nn.Module, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """Gather the full, unsharded state dict onto rank 0's CPU (a collective: every rank calls it). `trained_only`:
    only the parameters that train (LoRA: the adapters; nothing of the frozen base is gathered)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only)
    return get_model_state_dict(model, options=options)


def per_expert_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Transformers keeps MoE experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj); checkpoints on disk, and
    vLLM's loaders, use one tensor per expert and projection. Split the fused ones; other tensors pass through."""
    out = {}
    for key, value in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj") and value.dim() == 3:
            prefix, half = key.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :half].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = value[e, half:].contiguous()
        elif key.endswith("mlp.experts.down_proj") and value.dim() == 3:
            prefix = key.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[key] = value
    return out


def _tied(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def export_specs(model: torch.nn.Module, dtype: torch.dtype) -> list[TensorSpec]:
    """What `export_stream` yields, in its order, from the shapes alone (nothing is gathered)."""
    specs = []
    for name, value in get_model_state_dict(model).items():
        if _tied(model) and name == "lm_head.weight":
            continue
        meta = torch.empty(value.shape, dtype=dtype, device="meta")
        specs += [spec_of(key, tensor) for key, tensor in per_expert_tensors({name: meta}).items()]
    return specs


def export_stream(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective (every rank iterates it in step): the model's tensors in checkpoint layout and `dtype` (per-expert
    tensors, no tied head), gathered one parameter at a time, so no rank holds the whole model unsharded."""
    for name, value in get_model_state_dict(model).items():
        if _tied(model) and name == "lm_head.weight":
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        yield from per_expert_tensors({name: full.detach().to(dtype)}).items()


def save_hf_checkpoint(state_dict: dict[str, torch.Tensor], base_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `state_dict` as model.safetensors plus the base model's config and tokenizer files and the weights'
    fingerprint (FINGERPRINT_FILE: primerl.transport.fingerprint), atomically."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        if tensors["lm_head.weight"].data_ptr() == tensors["model.embed_tokens.weight"].data_ptr() or torch.equal(
            tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
        ):
            del tensors["lm_head.weight"]  # tied: HF and vLLM re-tie on load
    tensors = per_expert_tensors(tensors)
    with atomic_dir(out_dir) as staging:
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        for name in _COPIED_FILES:
            if (Path(base_dir) / name).exists():
                shutil.copy2(Path(base_dir) / name, staging / name)
        write_json(staging / FINGERPRINT_FILE, {"fingerprint": fingerprint_of(tensors)})
    return Path(out_dir)
