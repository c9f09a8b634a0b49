"""The trainer's model, built without any rank holding it whole: parameters are created on the meta device (no
memory), wrapped and sharded (FSDP2, EP) while still empty, materialised as this rank's shards only, and then filled
from the model directory.

Invariants:
- a rank's parameter memory is about the model's fp32 size / ranks: nothing allocates a full parameter, except
  the fallback below on rank 0;
- the loaded weights equal `from_pretrained`'s, cast to fp32, on any number of ranks (tests/test_model_load.py);
- buffers the checkpoint does not hold (rotary frequencies) keep the values the model's constructor computed: they
  are built for real (they are small), kept across `to_empty`, and put back;
- tied weights stay tied (the lm_head and the embedding are one Parameter before and after).

Two ways to fill the shards, chosen by the checkpoint's tensor names (read from the safetensors headers alone):
- **sharded read** when every weight is stored under the model's own name (dense HF models, primerl's own
  published weights), or, for the MoE experts transformers fuses ([E, 2I, H] gate_up_proj), one tensor per expert
  and projection (the Qwen3-MoE layout): each rank reads from the safetensors files only the slice of each tensor
  that it holds (the experts of its own rows, for fused experts), one tensor at a time;
- **rank 0 reads and scatters** otherwise (renamed keys, other fused layouts): rank 0 loads the
  model with `from_pretrained`, which knows every conversion, and `set_model_state_dict` broadcasts it, each rank
  keeping its shards; rank 0 then holds the whole model once, for the length of the load.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from primerl.config.model import LoraConfig
from primerl.config.trainer import TrainerConfig
from primerl.model.adapter import add_adapters, base_param_name, is_adapter_param, peft_key, start_value
from primerl.trainer.context_parallel import ContextParallel
from primerl.trainer.dist import DistInfo, data_mesh, mixed_precision, shard_model
from primerl.trainer.logprobs import ScoresHead
from primerl.trainer.routing_replay import install_routing_replay
from primerl.utils.log import get_logger

log = get_logger("trainer")


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers for real: a constructor's
    `torch.empty` for a parameter reserves no pages, and the parameter is moved to meta as it is registered."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(base: str | Path, attention: str) -> PreTrainedModel:
    """The model at `base`, in fp32, with its parameters on the meta device (buffers real, on the CPU)."""
    config = AutoConfig.from_pretrained(str(base))
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's (sharded) parameters on `device`, uninitialised, and put the constructor's buffers back."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


class StoredTensors:
    """The tensors of a model directory's safetensors files, by name, read one at a time. Each file is opened (its
    header parsed) once, not once per tensor: a MoE checkpoint holds tens of thousands of per-expert tensors."""

    def __init__(self, base: str | Path):
        self._opened: dict[Path, safe_open] = {}
        index = Path(base) / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: Path(base) / file for name, file in files.items()}
        else:
            self.file_of = {}
            for file in sorted(Path(base).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    self.file_of |= dict.fromkeys(f.keys(), file)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def read(self, name: str, part: tuple[slice, ...]) -> torch.Tensor:
        """The `part` of tensor `name`: only those bytes are read."""
        file = self.file_of[name]
        if file not in self._opened:
            self._opened[file] = safe_open(str(file), framework="pt")
        return self._opened[file].get_slice(name)[part]

    def read_experts(self, names: list[list[str]], part: tuple[slice, ...]) -> torch.Tensor:
        """Experts stored one tensor per expert and projection, stacked as transformers fuses them ([E, 2I, H]
        gate_up_proj: gate and up concatenated); `part`: the slices of the fused tensor's other dims."""
        return torch.stack([torch.cat([self.read(name, (slice(None),)) for name in expert])[part] for expert in names])


def fused_experts(name: str, experts: slice) -> list[list[str]] | None:
    """The per-expert tensor names (one list per expert) that transformers fuses into `name` (the layout
    primerl.trainer.weights.per_expert_tensors writes), or None when `name` is not a fused expert tensor."""
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        if name.endswith(f"mlp.experts.{fused}"):
            prefix = name.removesuffix(fused)
            return [[f"{prefix}{e}.{part}.weight" for part in parts] for e in range(experts.start, experts.stop)]
    return None


def local_part(value: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, the slices of the full tensor that it holds)."""
    if not isinstance(value, DTensor):
        return value, tuple(slice(0, n) for n in value.shape)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return value.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def plan_reads(state: dict[str, torch.Tensor], stored: StoredTensors) -> list | None:
    """(local tensor, read of its part) for each entry of this rank's `state`, or None when some weight is stored
    neither under its own name nor as per-expert tensors. A weight tied to one read earlier (an lm_head tied to the
    embedding) may be absent: filling one fills both."""
    reads, seen = [], set()
    for name, value in state.items():
        local, part = local_part(value)
        alias = local.numel() > 0 and local.data_ptr() in seen
        seen.add(local.data_ptr())
        experts = fused_experts(name, part[0]) if part else None
        if name in stored:
            reads.append((local, partial(stored.read, name, part)))
        elif experts is not None and all(n in stored for expert in experts for n in expert):
            reads.append((local, partial(stored.read_experts, experts, part[1:])))
        elif not alias:
            return None
    return reads


def load_weights(model: nn.Module, base: str | Path, info: DistInfo) -> str:
    """Collective: fill the materialised, sharded `model` with the weights at `base` (module docstring); a LoRA
    layer's wrapped weight (`base_layer.weight`) from the base's own name, adapters left out (`load_adapters`).
    Returns how: "sharded read" or "rank 0 read and scattered"."""
    sharded = get_model_state_dict(model)
    state = {base_param_name(k): v for k, v in sharded.items() if not is_adapter_param(k)}
    reads = plan_reads(state, StoredTensors(base))
    if reads is not None:
        with torch.no_grad():
            for local, read in reads:
                if local.numel():
                    local.copy_(read())
        return "sharded read"
    full = {}
    if info.is_main:
        full = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict()
        wrapped = {base_param_name(k): k for k in sharded if ".base_layer." in k}
        full = {wrapped.get(k, k): v for k, v in full.items()}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not has_adapters(model))
    set_model_state_dict(model, full, options=options)
    return "rank 0 read and scattered"


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter_param(name) for name, _ in model.named_parameters())


def load_adapters(model: nn.Module, adapter: str | Path | None, seed: int) -> None:
    """Fill this rank's shards of the adapter parameters: from the peft directory `adapter`, or, with None, with the
    seeded start values (primerl.model.adapter.start_value), drawn whole and cut to this rank's part."""
    stored = StoredTensors(adapter) if adapter is not None else None
    with torch.no_grad():
        for name, value in get_model_state_dict(model).items():
            if not is_adapter_param(name):
                continue
            local, part = local_part(value)
            if stored is None:
                local.copy_(start_value(name, value.shape, seed)[part])
            elif peft_key(name) in stored:
                local.copy_(stored.read(peft_key(name), part))
            else:
                raise ValueError(
                    f"the adapter {adapter} has no {peft_key(name)}: trained with other model.lora settings?"
                )


@dataclass
class AdapterSpec:
    """LoRA for the trainer's model: its settings, the peft directory to start from (None: the seeded start) and the
    seed of that start."""

    lora: LoraConfig
    start: str | Path | None = None
    seed: int = 0


def sharded_model(
    base: str | Path,
    info: DistInfo,
    compute: TrainerConfig,
    context: ContextParallel | None,
    ep: int,
    frozen: bool = False,
    adapter: AdapterSpec | None = None,
) -> tuple[nn.Module, set[nn.Parameter]]:
    """The model at `base` as the trainer runs it: a `ScoresHead` in place of its lm_head, `ReplayRouter`s in place of
    its MoE routers with `compute.moe.routing_replay` (primerl.trainer.routing_replay), LoRA adapters when asked
    (only they train), each decoder layer's activations checkpointed when asked, CP's attention, EP and FSDP2 over
    every rank (mixed precision per `compute.precision`), this rank's shards read from `base`. Returns it and its
    expert parameters (EP). `frozen`: no gradients, eval mode, no checkpointing (a reference policy)."""
    model = empty_model(base, compute.attention)
    model.train(not frozen)
    model.lm_head = ScoresHead(model.lm_head, compute.logprob_chunk_size)
    if compute.moe.routing_replay and not frozen:  # the reference routes by its own router
        install_routing_replay(model)
    if adapter is not None:
        with parameters_on_meta():
            add_adapters(model, adapter.lora, base)
    if compute.activation_checkpointing and not frozen:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if context:
        context.enable(model)
    mesh = data_mesh(info, info.world_size)
    expert_params = shard_model(model, mesh, ep, mixed_precision(compute.precision, info.device))
    materialize(model, info.device)
    how = load_weights(model, base, info)
    if adapter is not None:
        load_adapters(model, adapter.start, adapter.seed)
        how += f", LoRA rank {adapter.lora.rank} from {adapter.start or f'the seeded start (seed {adapter.seed})'}"
    if frozen:
        model.requires_grad_(False)
    if info.is_main:
        log.info(f"loaded {base}{' (reference)' if frozen else ''} on {info.world_size} rank(s): {how}")
    return model, expert_params
