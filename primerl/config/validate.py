"""Cross-field checks that a typed schema cannot express. Each failure names the offending key."""

import importlib.util
import math
from pathlib import Path

from primerl.config.algorithm import check_algorithm
from primerl.config.model_dir import check_model_dir
from primerl.config.schema import RunConfig
from primerl.inference.config import OWNED_VLLM_FLAGS, PdRole
from primerl.launch.config import JOB_ROLES
from primerl.model.config import ModelSource
from primerl.transport.config import WeightTransport
from primerl.utils.bounds import check_bounds
from primerl.utils.errors import ConfigError
from primerl.utils.process import is_loopback

# trainer.attention: transformers' attn_implementation -> the package it needs (None: torch's own)
ATTENTION_KERNELS = {
    "sdpa": None,
    "eager": None,
    "flex_attention": None,
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
}


def validate(cfg: RunConfig) -> None:
    """Raise ConfigError on the first field out of its range (declared beside it: primerl.utils.bounds), then on the
    first inconsistency between fields. Checks that need the world size live in `resolve_dp_shard`."""
    check_bounds(cfg)
    checks = (
        _orchestrator,
        _inference,
        _model,
        _lora,
        _data,
        _parallelism,
        check_algorithm,
        _launcher,
        _ledger,
        _weights,
    )
    for check in checks:
        check(cfg)


def _orchestrator(cfg: RunConfig) -> None:
    orch = cfg.orchestrator
    if orch.batch_size % orch.group_size:
        raise ConfigError(
            "orchestrator.batch_size",
            f"{orch.batch_size} is not divisible by orchestrator.group_size={orch.group_size}",
        )
    if orch.max_off_policy_steps is not None and orch.max_off_policy_steps < orch.async_level:
        raise ConfigError(
            "orchestrator.max_off_policy_steps",
            f"{orch.max_off_policy_steps} is below "
            f"orchestrator.async_level={orch.async_level}: batches allowed to run ahead would be dropped",
        )
    if orch.max_inflight < orch.group_size:
        raise ConfigError(
            "orchestrator.max_inflight",
            f"{orch.max_inflight} cannot hold one group of orchestrator.group_size={orch.group_size}",
        )
    if orch.drain_per_step and orch.max_inflight < orch.batch_size:
        raise ConfigError(
            "orchestrator.max_inflight",
            f"{orch.max_inflight} cannot hold one batch of "
            f"orchestrator.batch_size={orch.batch_size}, which drain_per_step starts at once",
        )


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


def _model(cfg: RunConfig) -> None:
    model, trainer = cfg.model, cfg.trainer
    if model.source == ModelSource.tiny:
        arch = model.arch
        if arch.num_attention_heads % arch.num_key_value_heads:
            raise ConfigError(
                "model.arch.num_key_value_heads",
                f"{arch.num_key_value_heads} must divide num_attention_heads={arch.num_attention_heads}",
            )
        for key, length in (("trainer.seq_len", trainer.seq_len), ("sft.seq_len", cfg.sft.seq_len)):
            if length > arch.max_position_embeddings:
                raise ConfigError(
                    key, f"{length} exceeds model.arch.max_position_embeddings={arch.max_position_embeddings}"
                )
    if model.source == ModelSource.hub and not model.hub_id:
        raise ConfigError("model.hub_id", "required when model.source=hub")
    if model.source == ModelSource.path and not model.path:
        raise ConfigError("model.path", "required when model.source=path")
    if model.source == ModelSource.path:
        check_model_dir(Path(model.path).expanduser(), "model.path")


def _data(cfg: RunConfig) -> None:
    if cfg.eval.k > cfg.eval.samples_per_task:  # pass@k and avg@k, of `eval` and of the online evals
        raise ConfigError("eval.k", f"{cfg.eval.k} exceeds eval.samples_per_task={cfg.eval.samples_per_task}")
    for i, entry in enumerate(cfg.mixture):
        if not (entry.weight > 0 and math.isfinite(entry.weight)):
            raise ConfigError(f"mixture[{i}].weight", f"{entry.weight} is not a positive sampling weight")
    if len({entry.id for entry in cfg.mixture}) < len(cfg.mixture):
        raise ConfigError("mixture", "each env may appear once (its id names its metrics)")
    if cfg.sft.data and not Path(cfg.sft.data).expanduser().exists():  # its rows: primerl.sft.data
        raise ConfigError("sft.data", f"{cfg.sft.data} is neither a JSONL file nor a datasets directory")


def _distinct_pd_ports(inf) -> None:
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


def _parallelism(cfg: RunConfig) -> None:
    model, trainer = cfg.model, cfg.trainer
    par = cfg.parallelism
    if par.dp_shard == 0 or par.dp_shard < -1:
        raise ConfigError("parallelism.dp_shard", f"must be >= 1 or -1 (all remaining ranks), got {par.dp_shard}")
    if par.ep > 1:
        experts = model.arch.num_experts
        if model.source != ModelSource.tiny or experts == 0:
            raise ConfigError("parallelism.ep", f"expert parallel needs a MoE model (model.arch.num_experts={experts})")
        if experts % par.ep:
            raise ConfigError("parallelism.ep", f"{par.ep} must divide model.arch.num_experts={experts}")
    if trainer.seq_len % par.cp:
        raise ConfigError("trainer.seq_len", f"{trainer.seq_len} is not divisible by parallelism.cp={par.cp}")
    if par.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError("parallelism.backend", f"'{par.backend}' is not one of [auto, gloo, nccl]")
    if trainer.precision not in ("fp32", "bf16"):
        raise ConfigError("trainer.precision", f"'{trainer.precision}' is not one of [fp32, bf16]")
    kernels = ATTENTION_KERNELS.get(trainer.attention, "unknown")
    if kernels == "unknown":
        raise ConfigError("trainer.attention", f"'{trainer.attention}' is not one of [{', '.join(ATTENTION_KERNELS)}]")
    if kernels and importlib.util.find_spec(kernels) is None:
        raise ConfigError("trainer.attention", f"{trainer.attention} needs the `{kernels}` package, not installed here")


def _ledger(cfg: RunConfig) -> None:
    if cfg.ledger.wandb.mode not in ("online", "offline", "disabled"):
        raise ConfigError("ledger.wandb.mode", f"'{cfg.ledger.wandb.mode}' is not one of [online, offline, disabled]")


def _launcher(cfg: RunConfig) -> None:
    lc = cfg.launcher
    if lc.name not in ("local", "slurm"):
        raise ConfigError("launcher.name", f"'{lc.name}' is not one of [local, slurm]")
    if lc.name == "local" and lc.trainer_nodes != 1:
        raise ConfigError(
            "launcher.trainer_nodes", f"{lc.trainer_nodes} nodes need launcher=slurm; local is one machine"
        )
    if lc.name == "slurm":
        if lc.signal_delay_s >= lc.time_limit_min * 60:
            raise ConfigError(
                "launcher.signal_delay_s",
                f"{lc.signal_delay_s}s is not shorter than the time limit launcher.time_limit_min={lc.time_limit_min}",
            )
        for role in lc.sbatch:
            if role not in JOB_ROLES:
                raise ConfigError(f"launcher.sbatch.{role}", f"'{role}' is not a job role; one of {list(JOB_ROLES)}")


def resolve_dp_shard(cfg: RunConfig, world_size: int) -> int:
    """The data-parallel shard degree for this world size.

    world = dp_shard x cp. Expert parallel shards the experts over all dp_shard ranks (ep == dp_shard), without cp.
    """
    par = cfg.parallelism
    dp = par.dp_shard if par.dp_shard != -1 else world_size // par.cp
    if dp * par.cp != world_size:
        raise ConfigError(
            "parallelism.dp_shard",
            f"dp_shard={dp} x cp={par.cp} = {dp * par.cp} does not equal the world size {world_size}",
        )
    if par.ep > 1 and (par.ep != dp or par.cp > 1):
        raise ConfigError(
            "parallelism.ep",
            f"{par.ep} must equal dp_shard={dp} with cp=1 (world size {world_size}): "
            "experts are sharded over all data-parallel ranks",
        )
    return dp
