"""Learning-rate schedules, as functions of the step (0-based)."""

import math


def warmup_cosine(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup_steps` to `peak`, then cosine decay to `min_ratio * peak` at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
