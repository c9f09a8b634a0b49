"""SFT warm-start settings (a section of the experiment, not a group)."""

from dataclasses import dataclass


@dataclass
class SftConfig:
    enabled: bool = True
    steps: int = 1500
    batch_size: int = 32  # sequences per optimizer step, across all ranks
    seq_len: int = 256  # packed row length
    lr: float = 3e-3
    warmup_steps: int = 50
    num_eval: int = 64
    # Fraction of demonstrations written in capitals (the reward is case-sensitive): a sloppy teacher, so the
    # warm-start has a habit for RL to unlearn (experiments/reverse_text). 0: every demonstration is correct.
    uppercase_fraction: float = 0.0
    save_every: int = 0  # also keep the checkpoint every N steps (<checkpoint>-step<N>); 0: only the final one
