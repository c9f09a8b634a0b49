"""Cross-field checks of what the inference servers serve and how the policy reaches them: ports, keys, vLLM flags,
prefill/decode pairs, LoRA, collective weights. Each failure names the offending key."""

from primerl.config.inference import OWNED_VLLM_FLAGS, InferenceConfig, PdRole
from primerl.config.model import ModelSource
from primerl.config.schema import RunConfig
from primerl.config.weights import WeightTransport
from primerl.utils.errors import ConfigError
from primerl.utils.process import is_loopback


def check_serving(cfg: RunConfig) -> None:
    for check in (_inference, _lora, _weights):
        check(cfg)


def _inference(cfg: RunConfig) -> None:
    orch, trainer, inf = cfg.orchestrator, cfg.trainer, cfg.inference
    if orch.max_tokens >= inf.max_model_len:
        raise ConfigError(
            "orchestrator.max_tokens",
            f"{orch.max_tokens} leaves no room for the prompt in inference.max_model_len={inf.max_model_len}",
        )
    if inf.pd.enabled:
        _distinct_pd_ports(inf)
    if inf.pd.role != PdRole.both and cfg.launcher.name != "slurm":
        raise ConfigError("inference.pd.role", "is set by launcher=slurm for its prefill and decode jobs; leave it out")
    if inf.replicas % cfg.launcher.inference_jobs:
        raise ConfigError(
            "launcher.inference_jobs",
            f"{cfg.launcher.inference_jobs} jobs cannot share inference.replicas={inf.replicas} evenly",
        )
    if inf.port and inf.port + inf.replicas - 1 > 65535:
        raise ConfigError("inference.replicas", f"{inf.replicas} replicas from port {inf.port} run past port 65535")
    if trainer.seq_len < inf.max_model_len:
        raise ConfigError(
            "trainer.seq_len",
            f"{trainer.seq_len} is shorter than inference.max_model_len={inf.max_model_len}: a full rollout must fit",
        )
    if inf.api_key is not None and not (inf.api_key.isascii() and inf.api_key.isprintable() and " " not in inf.api_key):
        raise ConfigError("inference.api_key", "must be printable ASCII without spaces (it travels in an HTTP header)")
    if not is_loopback(inf.host) and not inf.api_key:
        raise ConfigError("inference.api_key", f"required when inference.host={inf.host} is not a loopback address")
    for arg in inf.extra_args:
        flag = str(arg).split("=", 1)[0]
        if flag in OWNED_VLLM_FLAGS:
            raise ConfigError("inference.extra_args", f"{flag} is set by primerl ({OWNED_VLLM_FLAGS[flag]}), not here")


def _distinct_pd_ports(inf: InferenceConfig) -> None:
    """The routers (`inference.port` + i; 0: free ones) and the prefill and decode servers (`...prefill_port` + i,
    `...decode_port` + i) of the replicas' pairs each need ports of their own, below 65536."""
    named = [
        (key, port)
        for side, key, port in (
            ("router", "inference.port", inf.port),
            ("prefill", "inference.pd.prefill_port", inf.pd.prefill_port),
            ("decode", "inference.pd.decode_port", inf.pd.decode_port),
        )
        if port and side in inf.pd.role.sides  # on SLURM a prefill and a decode job are on their own nodes
    ]
    for i, (key, port) in enumerate(named):
        if port + inf.replicas - 1 > 65535:
            raise ConfigError(key, f"{inf.replicas} pairs from port {port} run past port 65535")
        for other, other_port in named[:i]:
            if abs(port - other_port) < inf.replicas:
                raise ConfigError(
                    key,
                    f"{other}, {key} share ports over inference.replicas={inf.replicas} pairs; the routers and the "
                    "prefill and decode servers each need their own",
                )


def _lora(cfg: RunConfig) -> None:
    """LoRA where it is built and checked: dense models under FSDP2 (and CP), one server per replica (no PD)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return
    if not lora.target_modules:
        raise ConfigError("model.lora.target_modules", "name at least one module to adapt (e.g. [q_proj, v_proj])")
    if cfg.parallelism.ep > 1 or (cfg.model.source == ModelSource.tiny and cfg.model.arch.num_experts):
        raise ConfigError(
            "model.lora.rank",
            "LoRA on a MoE model is not supported: peft wraps its fused experts in a layout that expert parallel "
            "and the served adapter are not built for; use a dense model or model.lora.rank=0",
        )
    if cfg.inference.pd.enabled:
        raise ConfigError("model.lora.rank", "prefill/decode servers take no adapters; set inference.pd.enabled=false")


def _weights(cfg: RunConfig) -> None:
    """Collective weights go to whole models on workers that can reach trainer rank 0."""
    if cfg.weights.transport != WeightTransport.collective:
        for key in ("delta", "relay"):
            if getattr(cfg.weights, key):
                raise ConfigError(f"weights.{key}", "this is for process groups only; set weights.transport=collective")
        return
    if cfg.model.lora.enabled:
        raise ConfigError(
            "weights.transport", "a LoRA policy is an adapter the servers load from a file; use filesystem"
        )
    if cfg.inference.pd.enabled:
        raise ConfigError("weights.transport", "prefill/decode servers load weights from files only; use filesystem")
    if cfg.launcher.name == "slurm" and cfg.weights.host is not None and is_loopback(cfg.weights.host):
        raise ConfigError(
            "weights.host",
            f"{cfg.weights.host} is loopback: inference workers on other nodes cannot reach the trainer there; "
            "leave it unset (the trainer node's name) or give an address they reach",
        )
