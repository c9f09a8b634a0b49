"""Inference group: how the vLLM server is started."""

from dataclasses import dataclass, field
from enum import Enum

from primerl.utils.bounds import bounded


class Quantization(Enum):
    none = "none"
    fp8 = "fp8"


class KvCacheDtype(Enum):
    auto = "auto"
    fp8 = "fp8"


@dataclass
class PdConfig:
    """Prefill/decode disaggregation: two vLLM servers joined by a KV connector, behind a router at
    `inference.port` (primerl.inference.pd_router). On CPU the connector is ExampleConnector."""

    enabled: bool = False
    kv_connector: str = "NixlConnector"
    prefill_port: int = bounded(8100, ge=1, le=65535)
    decode_port: int = bounded(8200, ge=1, le=65535)


@dataclass
class InferenceConfig:
    name: str = "vllm"
    host: str = "127.0.0.1"
    port: int = bounded(8000, ge=0, le=65535)  # 0: a free port
    # vLLM servers serving the same policy, replica i on port + i; the orchestrator spreads rollouts over them
    # (primerl.orchestrator.replicas) and loads every new policy into all of them at once
    replicas: int = bounded(1, ge=1)
    # required when `host` is not a loopback address; by default read from the environment variable PRIMERL_API_KEY
    # (primerl.utils.secrets), which is how every process of a run gets it and how to give it without a command line
    api_key: str | None = "${oc.env:PRIMERL_API_KEY,null}"
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int = bounded(512, ge=2)
    gpu_memory_utilization: float = bounded(0.5, gt=0, le=1)
    cpu_kv_cache_gib: int = bounded(1, ge=1)
    # CPU only: how long vLLM's worker busy-waits (sched_yield) for the next engine step before it sleeps on a
    # socket; vLLM's own is 1 s. On a small machine that spin holds a core the trainer needs; 0.005 gives it back
    # (measured: benchmarks/results.md, "Step profile"). None: vLLM's.
    cpu_idle_spin_s: float | None = bounded(0.005, ge=0)
    # None: eager on CPU (no graph capture or compile wait), CUDA graphs on GPU; true / false to choose
    enforce_eager: bool | None = None
    quantization: Quantization = Quantization.none
    kv_cache_dtype: KvCacheDtype = KvCacheDtype.auto
    pd: PdConfig = field(default_factory=PdConfig)
    startup_timeout_s: float = bounded(600.0, gt=0)
    # more vLLM flags, as given; the flags primerl sets itself (OWNED_VLLM_FLAGS) are a config error here
    extra_args: list[str] = field(default_factory=list)


# vLLM flags primerl renders, or that would open the server past its loopback-and-key rule, with the setting that
# owns each (vLLM keeps the last occurrence of a flag, so a second one would silently win)
OWNED_VLLM_FLAGS = {
    "--host": "inference.host",
    "--port": "inference.port",
    "--uds": "inference.host",
    "--api-key": "inference.api_key",
    "--middleware": "primerl's own middlewares",
    "--root-path": "primerl's routes",
    "--allowed-origins": "primerl's routes",
    "--allowed-methods": "primerl's routes",
    "--allowed-headers": "primerl's routes",
    "--allow-credentials": "primerl's routes",
    "--model": "model",
    "--served-model-name": "primerl's served name",
    "--worker-extension-cls": "primerl's weight loads",
    "--enable-scale-out": "primerl's token-in/token-out route",
    "--logprobs-mode": "the trainer's loss",
    "--return-tokens-as-token-ids": "the verifiers train client",
    "--max-logprobs": "the verifiers train client",
    "--max-model-len": "inference.max_model_len",
    "--dtype": "model.dtype",
    "--seed": "seed",
    "--quantization": "inference.quantization",
    "--kv-cache-dtype": "inference.kv_cache_dtype",
    "--gpu-memory-utilization": "inference.gpu_memory_utilization",
    "--kv-transfer-config": "inference.pd",
    "--enable-lora": "model.lora",
    "--max-lora-rank": "model.lora.rank",
    "--max-loras": "model.lora",
    "--lora-modules": "model.lora",
}


def replica_ports(inf: InferenceConfig) -> list[int]:
    """The ports of the inference replicas, in replica order: consecutive from `inference.port`."""
    return [inf.port + i for i in range(inf.replicas)]


def served_ports(inf: InferenceConfig) -> list[int]:
    """Every port the inference servers listen on: the replicas', or with PD the router's (`port`) and the prefill
    and decode servers'."""
    if inf.pd.enabled:
        return [port for port in (inf.port, inf.pd.prefill_port, inf.pd.decode_port) if port]
    return replica_ports(inf)


def replica_urls(inf: InferenceConfig) -> list[str]:
    """Base URLs of the inference replicas, in replica order."""
    return [f"http://{inf.host}:{port}" for port in replica_ports(inf)]
