"""Per-token terms of the RL policy losses, by name (`trainer.loss.type`). primerl.trainer.loss reduces them.

Notation, for sampled token t of sequence i (a sample: one rollout branch), with the inference policy pi_inf that
sampled it (the only "old" policy in an asynchronous run) and A_i its advantage:

    r_t = pi_theta(y_t) / pi_inf(y_t)            lo, hi = trainer.loss.clip_ratio_low, clip_ratio_high
    sg(.) = stop-gradient

    is_pg     -r_t A_i                                      IS-weighted policy gradient (primerl's default)
    ppo_clip  -min(r_t A_i, clip(r_t, lo, hi) A_i)          PPO's clipped surrogate; lo = 1 - eps_low and
                                                            hi = 1 + eps_high apart: DAPO's clip-higher
    gspo      -min(s_it A_i, clip(s_it, lo, hi) A_i)        GSPO (Zheng et al. 2025, GSPO-token form):
              s_i = exp(mean_{t in i} log r_t),             s_it = sg(s_i) pi_theta(y_t) / sg(pi_theta(y_t)); its
                                                            value is s_i, its gradient s_i grad log pi_theta(y_t);
                                                            with reduction=sequence this is GSPO's sequence
                                                            objective (the paper clips at 1 -/+ 3e-4 / 4e-4)
    cispo     -sg(clip(r_t, lo, hi)) A_i log pi_theta(y_t)  CISPO (MiniMax-M1): the IS weight clipped and
                                                            detached, so every token keeps a gradient
    custom    trainer.loss.custom = "package.module:function", called as
              function(logprobs, inference_logprobs, advantages, mask) -> terms, all [B, T] tensors (logprobs with
              gradient, mask bool: the sampled tokens); it returns the per-token loss terms, which are reduced here
              like the others.

Every type also drops the tokens outside primerl's trust region (mask_ratio_low <= r_t <= mask_ratio_high).
"""

import torch

from primerl.config.trainer import CUSTOM_LOSS_PARAMETERS, LOSS_TYPES
from primerl.utils.dotted import load_function
from primerl.utils.errors import ConfigError


def segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its sequence within the packed row (a new one starts where the position is 0)."""
    return torch.cumsum(position_ids == 0, dim=1) - 1


def per_sequence(values: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Per token, the sum of `values` over the tokens of its sequence (same row, same segment)."""
    rows, length = values.shape
    flat = (segment + torch.arange(rows, device=segment.device).unsqueeze(1) * length).reshape(-1)
    sums = torch.zeros(rows * length, dtype=values.dtype, device=values.device).index_add(0, flat, values.reshape(-1))
    return sums[flat].view(rows, length)


def token_terms(
    kind: str,
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment: torch.Tensor | None,
    clip: tuple[float, float],
    custom: str | None = None,
) -> torch.Tensor:
    """The per-token loss terms of loss type `kind` (module docstring), [B, T]; tokens outside `mask` are
    arbitrary (the reduction gives them weight 0). `segment`: each token's sequence (from `segments`; gspo only)."""
    log_ratio = logprobs - inference_logprobs
    low, high = clip
    if kind == "is_pg":
        return -torch.exp(log_ratio) * advantages
    if kind == "ppo_clip":
        ratio = torch.exp(log_ratio)
        return -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
    if kind == "gspo":
        masked = mask.to(log_ratio.dtype)
        lengths = per_sequence(masked, segment).clamp(min=1)
        sequence_ratio = torch.exp(per_sequence(log_ratio.detach() * masked, segment) / lengths)
        ratio = sequence_ratio * torch.exp(logprobs - logprobs.detach())
        return -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
    if kind == "cispo":
        return -torch.exp(log_ratio).detach().clamp(low, high) * advantages * logprobs
    if kind == "custom":
        function = load_function(custom, CUSTOM_LOSS_PARAMETERS, "trainer.loss.custom")
        return function(logprobs, inference_logprobs, advantages, mask)
    raise ConfigError("trainer.loss.type", f"unknown loss {kind!r}; choose one of {', '.join(LOSS_TYPES)}")
