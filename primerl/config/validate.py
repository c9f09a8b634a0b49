"""Cross-field checks that a typed schema cannot express. Each failure names the offending key."""

import importlib.util
import math
import os
from pathlib import Path

from primerl.config.algorithm import check_algorithm
from primerl.config.inference import served_ports
from primerl.config.launcher import JOB_ROLES
from primerl.config.model import ModelSource
from primerl.config.model_dir import check_model_dir
from primerl.config.schema import RunConfig
from primerl.config.serving import check_serving
from primerl.config.teacher import teacher_ports
from primerl.utils.bounds import check_bounds
from primerl.utils.errors import ConfigError
from primerl.utils.process import is_loopback
from primerl.utils.secrets import METRICS_TOKEN_ENV

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
        check_serving,
        _model,
        _data,
        _parallelism,
        check_algorithm,
        _launcher,
        _ledger,
        _teacher,
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
    if trainer.moe.routing_replay:
        experts = model.arch.num_experts
        if model.source == ModelSource.tiny and experts == 0:
            raise ConfigError("trainer.moe.routing_replay", "routes experts: needs a MoE model (model=tiny_moe or one)")
        if par.cp > 1:
            raise ConfigError("trainer.moe.routing_replay", f"not supported with parallelism.cp={par.cp} (use cp=1)")
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
    live = cfg.ledger.prometheus
    if live.port and not is_loopback(live.host) and not (os.environ.get(METRICS_TOKEN_ENV) or cfg.inference.api_key):
        raise ConfigError(
            "ledger.prometheus.host",
            f"{live.host} is not a loopback address: set {METRICS_TOKEN_ENV} or inference.api_key, which a scrape must "
            "then present",
        )


def _teacher(cfg: RunConfig) -> None:
    teacher = cfg.teacher
    if teacher.path is None:
        return
    check_model_dir(Path(teacher.path).expanduser(), "teacher.path")
    if cfg.launcher.name == "slurm":
        return  # the teacher's own job, on its node's port (primerl.launch.slurm)
    taken = sorted(
        set(teacher_ports(teacher, cfg.inference.port, cfg.inference.replicas)) & set(served_ports(cfg.inference))
    )
    if taken:
        raise ConfigError("teacher.port", f"{taken[0]} is a policy server's port; pick another")


def _launcher(cfg: RunConfig) -> None:
    lc = cfg.launcher
    if lc.name not in ("local", "slurm"):
        raise ConfigError("launcher.name", f"'{lc.name}' is not one of [local, slurm]")
    if lc.name == "local" and lc.trainer_nodes != 1:
        raise ConfigError(
            "launcher.trainer_nodes", f"{lc.trainer_nodes} nodes need launcher=slurm; local is one machine"
        )
    if lc.colocate:
        _colocate(cfg)
    if lc.name == "slurm":
        if lc.signal_delay_s >= lc.time_limit_min * 60:
            raise ConfigError(
                "launcher.signal_delay_s",
                f"{lc.signal_delay_s}s is not shorter than the time limit launcher.time_limit_min={lc.time_limit_min}",
            )
        for role in lc.sbatch:
            if role not in JOB_ROLES:
                raise ConfigError(f"launcher.sbatch.{role}", f"'{role}' is not a job role; one of {list(JOB_ROLES)}")


def _colocate(cfg: RunConfig) -> None:
    """Colocated processes take turns on this machine's cores: they must never run at once."""
    if cfg.launcher.name != "local":
        raise ConfigError("launcher.colocate", "shares one machine's cores; it needs launcher=local")
    if cfg.inference.device == "cuda":
        raise ConfigError("launcher.colocate", "is for CPU; on one GPU set launcher.share_gpu=true instead")
    if cfg.orchestrator.async_level != 0:
        raise ConfigError(
            "launcher.colocate",
            f"takes turns, so generation and training never overlap: it needs orchestrator.async_level=0 "
            f"(it is {cfg.orchestrator.async_level})",
        )


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
