"""Learning-rate schedules, as functions of the step (0-based)."""

import math

from primerl.config.trainer import LrScheduleConfig


def warmup_cosine(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup_steps` to `peak`, then cosine decay to `min_ratio * peak` at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def scheduled_lr(schedule: LrScheduleConfig, step: int, peak: float, total_steps: int) -> float:
    """The RL learning rate of `step` under trainer.lr_schedule: constant; warmup (linear over warmup_steps, then
    constant); cosine (the warm-up, then cosine decay to min_ratio x peak at total_steps)."""
    if schedule.type == "constant":
        return peak
    if schedule.type == "warmup":
        return peak * min(1.0, (step + 1) / schedule.warmup_steps) if schedule.warmup_steps else peak
    if schedule.type == "cosine":
        return warmup_cosine(step, peak, schedule.warmup_steps, total_steps, schedule.min_ratio)
    raise ValueError(f"unknown trainer.lr_schedule.type {schedule.type!r}")
