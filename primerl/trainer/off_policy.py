"""Off-policy corrections (`trainer.loss.off_policy`): how much a token sampled by the inference policy pi_inf may
teach the trainer's policy pi_theta.

In an asynchronous run the tokens of a batch were sampled by older policy versions, through another engine's
numerics (and, for MoE models, possibly other experts). With rho_t = pi_theta(y_t) / pi_inf(y_t) at this pass
(detached: the trainer's policy before this step's update, verl's "old" policy), the IS weight w of token t is

    token      w_t = rho_t
    sequence   w_t = prod_{u in i} rho_u            (every token u of t's sequence i: one weight per sequence)
    geometric  w_t = exp(mean_{u in i} log rho_u)   (the per-token geometric mean of the sequence's ratios)

and a correction turns it into the token's weight c_t and whether it keeps its loss k_t:

    tis   c_t = min(w_t, high), k_t = 1                 truncated IS (Ionides 2008; Yao et al. 2025's TIS at
                                                         token level); the fraction with w_t > high is logged
    mask  c_t = w_t, k_t = 1[low <= w_t <= high]        masked IS (MIS); at sequence or geometric level whole
                                                         sequences go; at token level with low > 0 this is
                                                         IcePop's two-sided token mask (Ling team, 2025)

With a correction the loss type's own ratio is taken against the trainer's policy at this pass instead of pi_inf
(value 1, gradient grad log pi_theta: decoupled PPO's proximal policy, Hilton et al. 2021), so the importance
weight enters once, through c_t: loss_t = k_t c_t term_t. Without one (`none`) the loss types' ratio against pi_inf
carries it untruncated, as before. Logged per step: the IS weight's mean and max over sampled tokens, and the
fraction of sampled tokens truncated or masked.
"""

from dataclasses import dataclass

import torch

from primerl.config.trainer import OffPolicyConfig
from primerl.trainer.loss_terms import per_sequence


@dataclass
class Correction:
    weights: torch.Tensor  # c_t, detached
    keep: torch.Tensor  # k_t, bool
    sums: dict[str, float]  # is_weight (sum over sampled tokens), is_weight_max, corrected (tokens truncated/masked)


def importance_weights(level: str, log_rho: torch.Tensor, mask: torch.Tensor, segment: torch.Tensor | None):
    """w_t of the module docstring from the detached log-ratios; `segment` (each token's sequence) unless token."""
    if level == "token":
        return torch.exp(log_rho)
    masked = mask.to(log_rho.dtype)
    total = per_sequence(log_rho * masked, segment)
    if level == "sequence":
        return torch.exp(total)
    return torch.exp(total / per_sequence(masked, segment).clamp(min=1))


def correct(
    cfg: OffPolicyConfig, log_rho: torch.Tensor, mask: torch.Tensor, segment: torch.Tensor | None
) -> Correction:
    """c_t and k_t for the sampled tokens `mask` ([B, T] like `log_rho`, the detached log pi_theta - log pi_inf)."""
    weight = importance_weights(cfg.level, log_rho.detach().double(), mask, segment)
    if cfg.correction == "tis":
        affected = weight > cfg.high
        weights, keep = weight.clamp(max=cfg.high), torch.ones_like(mask)
    else:
        keep = (weight >= cfg.low) & (weight <= cfg.high)
        affected, weights = ~keep, weight
    sampled = weight[mask]
    sums = {
        "is_weight": sampled.sum().item(),
        "is_weight_max": sampled.max().item() if sampled.numel() else 0.0,
        "corrected": int((affected & mask).sum()),
    }
    return Correction(weights.to(log_rho.dtype), keep, sums)
