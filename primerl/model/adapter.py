"""LoRA adapters in peft's format: how the trainer adds them to a model, how one is written, and the seeded start.

A published adapter is a directory that peft (`PeftModel.from_pretrained`) and vLLM (`--lora-modules`,
`/v1/load_lora_adapter`) both load: `adapter_config.json` (peft's LoraConfig, naming the base model) and
`adapter_model.safetensors`, whose keys are peft's: `base_model.model.<module>.lora_A.weight` for the model's
`<module>.lora_A.default.weight`. Only adapter tensors are in it: rank 8 on every projection of the tiny model is
78k parameters, 0.32 MB in fp32 against the model's 3.3 MB; rank 16 on Qwen3-8B's (36 layers, hidden 4096, MLP
12288) is 43.6M parameters, 87 MB in bf16 against 16 GB.

Invariants:
- the start adapter is a pure function of (model, `model.lora`, seed): every process that builds it gets the same
  bytes, so the trainer's first policy and the served one are the same function;
- it changes nothing at the start: lora_B is zero (peft's default init), so base + start adapter == base;
- lora_A is peft's default init (Kaiming-uniform with a = sqrt(5)), drawn per tensor from a generator seeded by the
  run's seed and the tensor's name, so a tensor's values do not depend on how many ranks hold it or in which order.
"""

import hashlib
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from primerl.config.model import LoraConfig
from primerl.transport.atomic import atomic_dir
from primerl.transport.fingerprint import fingerprint_of
from primerl.transport.weights import ADAPTER_CONFIG_FILE, write_fingerprint
from primerl.utils.errors import ConfigError

ADAPTER_FILE = "adapter_model.safetensors"
PEFT_ADAPTER = "default"  # the adapter's name inside the model (peft's)
PEFT_PREFIX = "base_model.model."  # what peft's saved keys put before the model's own names


def peft_config(lora: LoraConfig, base: str | Path):
    """peft's LoraConfig for `lora`, naming the base model directory."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        base_model_name_or_path=str(base),
        task_type="CAUSAL_LM",
    )


def add_adapters(model: torch.nn.Module, lora: LoraConfig, base: str | Path) -> None:
    """Wrap each target module of `model` in a LoRA layer, in place (module paths stay; a target's weight becomes
    `<module>.base_layer.weight`); the base weights are frozen, the adapters' `requires_grad`."""
    from peft import inject_adapter_in_model

    with warnings.catch_warnings():  # peft warns about its own MoE patterns that match no module of a dense model
        warnings.simplefilter("ignore", RuntimeWarning)
        inject_adapter_in_model(peft_config(lora, base), model, adapter_name=PEFT_ADAPTER)
    found = [name for name, _ in model.named_parameters() if is_adapter_param(name)]
    if not found:
        raise ConfigError("model.lora.target_modules", f"{list(lora.target_modules)} match no module of {base}")


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_param_name(name: str) -> str:
    """The name a wrapped module's own weight has in the base checkpoint (`q_proj.base_layer.weight` ->
    `q_proj.weight`); other names are returned as they are."""
    return name.replace(".base_layer.", ".")


def peft_key(name: str) -> str:
    """The key peft saves the model's adapter parameter `name` under."""
    return PEFT_PREFIX + name.replace(f".{PEFT_ADAPTER}.", ".")


def start_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The start value of adapter parameter `name` (module docstring)."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    bound = math.sqrt(6 / ((1 + 5) * shape[-1]))  # kaiming_uniform_(a=sqrt(5)): gain^2 = 2 / (1 + a^2)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def adapter_shapes(base: str | Path, lora: LoraConfig) -> Iterator[tuple[str, torch.Size]]:
    """(name, shape) of each adapter parameter `lora` adds to the model at `base` (built on the meta device)."""
    config = AutoConfig.from_pretrained(str(base))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        add_adapters(model, lora, base)
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            yield name, param.shape


def save_adapter(
    tensors: dict[str, torch.Tensor],
    lora: LoraConfig,
    base: str | Path,
    out_dir: str | Path,
    replace: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the adapter `tensors` (by the model's parameter names) in peft's format at `out_dir`, in `dtype` (the
    served model's), with their fingerprint (what a server's load proves), atomically and STABLE-marked.
    `replace=False`: a directory already there is kept (another process wrote the same one)."""
    saved = {peft_key(name): value.detach().to(dtype).contiguous().cpu() for name, value in tensors.items()}
    with atomic_dir(out_dir, replace=replace) as staging:
        save_file(saved, staging / ADAPTER_FILE, metadata={"format": "pt"})
        peft_config(lora, base).save_pretrained(str(staging))
        write_fingerprint(staging, fingerprint_of(saved))
    return Path(out_dir)


def merge_adapters(state: dict[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The full state dict of a model with LoRA layers, merged: each wrapped weight W becomes
    W + B @ A * alpha / rank under the base model's own name, and the adapters go."""
    merged = {}
    for name, value in state.items():
        if is_adapter_param(name):
            continue
        if name.endswith(".base_layer.weight"):
            module = name.removesuffix("base_layer.weight")
            a, b = state[f"{module}lora_A.{PEFT_ADAPTER}.weight"], state[f"{module}lora_B.{PEFT_ADAPTER}.weight"]
            value = value + (b.float() @ a.float()).to(value.dtype) * (lora.alpha / lora.rank)
        merged[base_param_name(name)] = value
    return merged


def adapter_settings(path: str | Path) -> tuple[str, int]:
    """(the base model directory, the rank) that the adapter at `path` names in its adapter_config.json."""
    config = json.loads((Path(path) / ADAPTER_CONFIG_FILE).read_text())
    return config["base_model_name_or_path"], int(config["r"])


def write_start_adapter(base: str | Path, lora: LoraConfig, seed: int, out_dir: str | Path) -> Path:
    """The start adapter (module docstring) at `out_dir`; kept if a process wrote it first."""
    tensors = {name: start_value(name, shape, seed) for name, shape in adapter_shapes(base, lora)}
    return save_adapter(tensors, lora, base, out_dir, replace=False)
