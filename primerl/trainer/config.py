"""Trainer and parallelism groups."""

from dataclasses import dataclass, field


@dataclass
class ParallelismConfig:
    """Device-mesh degrees. dp_shard=-1 means: every rank not used by ep/cp shards data (FSDP2)."""

    name: str = "fsdp2"
    dp_shard: int = -1
    ep: int = 1
    cp: int = 1
    backend: str = "auto"  # auto: nccl with CUDA, gloo on CPU


@dataclass
class OptimConfig:
    lr: float = 3e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0


@dataclass
class LossConfig:
    """IS-corrected policy gradient: tokens whose trainer/inference ratio leaves [mask_ratio_low, mask_ratio_high]
    get no loss (formula in primerl/trainer/loss.py)."""

    mask_ratio_low: float = 0.125
    mask_ratio_high: float = 8.0


@dataclass
class TrainerConfig:
    seq_len: int = 512
    micro_batch_size: int = 8  # packed rows per forward/backward pass
    max_steps: int = 20
    checkpoint_every: int = 1  # steps between model+optimizer checkpoints (resume point after a crash)
    keep_checkpoints: int = 2
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
