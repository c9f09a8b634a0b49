"""Trainer and parallelism groups."""

from dataclasses import dataclass, field

from primerl.utils.bounds import bounded


@dataclass
class ParallelismConfig:
    """Device-mesh degrees. dp_shard=-1 means: every rank not used by ep/cp shards data (FSDP2)."""

    name: str = "fsdp2"
    dp_shard: int = -1
    ep: int = bounded(1, ge=1)
    cp: int = bounded(1, ge=1)
    backend: str = "auto"  # auto: nccl with CUDA, gloo on CPU


@dataclass
class OptimConfig:
    lr: float = bounded(3e-5, gt=0)
    weight_decay: float = bounded(0.0, ge=0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = bounded(1.0, gt=0)


@dataclass
class LossConfig:
    """IS-corrected policy gradient: tokens whose trainer/inference ratio leaves [mask_ratio_low, mask_ratio_high]
    get no loss (formula in primerl/trainer/loss.py)."""

    mask_ratio_low: float = bounded(0.125, ge=0, le=1)
    mask_ratio_high: float = bounded(8.0, ge=1)


@dataclass
class TrainerConfig:
    seq_len: int = bounded(512, ge=2)
    micro_batch_size: int = bounded(8, ge=1)  # packed rows per forward/backward pass
    max_steps: int = bounded(20, ge=1)
    checkpoint_every: int = bounded(1, ge=1)  # steps between model+optimizer checkpoints (resume point after a crash)
    keep_checkpoints: int = bounded(2, ge=1)
    # write each checkpoint while the next step trains (primerl/trainer/checkpoint.py, AsyncCheckpointer); a kill
    # during the write replays the steps since the checkpoint before it from their stored batches
    checkpoint_async: bool = True
    # steps in a row whose loss or grad norm is not finite (each is skipped) that stop the run
    max_nonfinite_steps: int = bounded(3, ge=1)
    # fp32: compute in fp32; bf16: compute in bf16, gradients reduced in fp32. The optimizer always updates fp32
    # master weights; the weights served are written in model.dtype.
    precision: str = "fp32"
    # tokens scored at a time from the final hidden states (primerl/trainer/logprobs.py): memory ~ chunk x vocab x
    # 4 bytes instead of a whole micro-batch's; null: the whole micro-batch at once (the full-vocabulary tensor)
    logprob_chunk_size: int | None = bounded(1024, ge=1)
    # recompute each decoder layer's activations in the backward instead of keeping them (less memory, ~1/3 more
    # compute)
    activation_checkpointing: bool = False
    # the trainer's attention kernels (transformers' attn_implementation): sdpa, eager, or flash_attention_2 /
    # flash_attention_3 / flex_attention where installed; context parallel uses its own (trainer/context_parallel.py)
    attention: str = "sdpa"
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
