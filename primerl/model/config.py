"""Model group: which causal LM the run trains and serves."""

from dataclasses import dataclass, field
from enum import Enum


class ModelSource(Enum):
    tiny = "tiny"  # built locally from `arch` and `init_seed`, cached by its config hash
    hub = "hub"  # a Hugging Face hub id (GPU users; needs the hub or a warm HF cache)
    path = "path"  # a local directory in Hugging Face format


@dataclass
class TinyArchConfig:
    """Qwen3 architecture knobs for the locally built model (dense when num_experts == 0)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128


@dataclass
class ModelConfig:
    name: str = "tiny"
    source: ModelSource = ModelSource.tiny
    hub_id: str | None = None
    path: str | None = None
    init_seed: int = 0
    dtype: str = "float32"
    arch: TinyArchConfig = field(default_factory=TinyArchConfig)
