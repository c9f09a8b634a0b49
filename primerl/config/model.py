"""Model group: which causal LM the run trains and serves."""

from dataclasses import dataclass, field
from enum import Enum

from primerl.utils.bounds import bounded


class ModelSource(Enum):
    tiny = "tiny"  # built locally from `arch` and `init_seed`, cached by its config hash
    hub = "hub"  # a Hugging Face hub id (GPU users; needs the hub or a warm HF cache)
    path = "path"  # a local directory in Hugging Face format


@dataclass
class TinyArchConfig:
    """Qwen3 architecture knobs for the locally built model (dense when num_experts == 0)."""

    hidden_size: int = bounded(128, ge=1)
    num_hidden_layers: int = bounded(4, ge=1)
    num_attention_heads: int = bounded(4, ge=1)
    num_key_value_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(32, ge=1)
    intermediate_size: int = bounded(384, ge=1)
    max_position_embeddings: int = bounded(512, ge=2)
    rope_theta: float = bounded(10000.0, gt=0)
    # std of the normal init of every weight matrix and the (tied) embedding: HF's default 0.02. experiment=reverse_text
    # sets 0.08 (~1/sqrt(hidden_size)), which shortens its SFT loss plateau (experiments/reverse_text).
    initializer_range: float = bounded(0.02, gt=0)
    num_experts: int = bounded(0, ge=0)  # 0: dense
    num_experts_per_tok: int = bounded(2, ge=1)
    moe_intermediate_size: int = bounded(128, ge=1)
    # <tool_call> and </tool_call> as single tokens (2 more vocabulary rows): tool-use experiments. Off by default so
    # the other experiments keep their measured weights.
    tool_call_tokens: bool = False


# every projection of a Qwen3 / Llama decoder layer: attention and MLP (not the MoE experts, which transformers fuses
# into 3-D parameters that LoRA layers do not wrap)
LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """Low-rank adapters (peft's LoRA) on `target_modules`; only they train, the base weights stay frozen, and each
    RL step publishes the adapter alone (primerl.model.adapter). rank 0: off, every weight trains."""

    rank: int = bounded(0, ge=0, le=512)
    alpha: float = bounded(16.0, gt=0)  # the update is B @ A * alpha / rank
    dropout: float = bounded(0.0, ge=0, lt=1)  # on the adapter's input, in training only (vLLM serves without it)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ModelConfig:
    name: str = "tiny"
    source: ModelSource = ModelSource.tiny
    hub_id: str | None = None
    path: str | None = None
    init_seed: int = 0
    dtype: str = "float32"
    arch: TinyArchConfig = field(default_factory=TinyArchConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
