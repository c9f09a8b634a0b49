"""Advantages by name (`orchestrator.advantage`), each from the rewards of one group (same task, same policy), and
the online difficulty filter (`orchestrator.filter`).

For rewards r_1..r_G of a group, mean m and population standard deviation s:

    mean  A_i = r_i - m                          primerl's default: no division, so a nearly-uniform group is not
                                                 blown up into large advantages
    grpo  A_i = (r_i - m) / (s + 1e-6)           GRPO (Shao et al. 2024): normalised by the group's spread
    rloo  A_i = r_i - mean_{j != i} r_j          REINFORCE leave-one-out (Ahmadian et al. 2024):
              = G / (G - 1) * (r_i - m)          an unbiased baseline; 0 for a group of one

A group whose rewards are all equal gets zero advantages under every estimator: it carries no signal.
"""

import math

from primerl.config.orchestrator import ADVANTAGES

GRPO_EPS = 1e-6


def group_advantages(rewards: list[float], kind: str = "mean") -> list[float]:
    if not rewards:
        return []
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if kind == "mean":
        return centred
    if kind == "grpo":
        std = math.sqrt(sum(c * c for c in centred) / n)
        return [c / (std + GRPO_EPS) for c in centred]
    if kind == "rloo":
        return [c * n / (n - 1) for c in centred] if n > 1 else [0.0]
    raise ValueError(f"unknown advantage {kind!r}; choose one of {', '.join(ADVANTAGES)}")
