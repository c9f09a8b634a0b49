"""The RL loss: importance-sampling corrected policy gradient, token-level normalised, with a trust-region mask.

For every sampled token t (loss_mask) of every sample in the global batch:

    r_t   = exp(log pi_theta(y_t | y_<t) - log pi_inf(y_t | y_<t))        # trainer vs inference policy
    m_t   = 1 if mask_ratio_low <= r_t <= mask_ratio_high else 0            # tokens outside the region: no loss
    loss  = -(1 / N) * sum_t m_t * r_t * A_t                                # N = sampled tokens in the batch

A_t is the sample's group-relative advantage. The gradient is -(1/N) sum_t m_t r_t A_t grad log pi_theta(y_t),
the policy gradient re-weighted from the inference policy (which sampled, possibly some versions ago and with
different numerics) to the trainer's. N counts all sampled tokens of the global batch, masked or not, so every
token weighs the same whatever its sequence length (token-level normalisation) and 1 rank = N ranks.
Logged: mismatch KL = mean_t (r_t - 1 - log r_t) (k3 estimator of KL(pi_inf || pi_theta)), the masked fraction,
and the policy's entropy on sampled positions.
"""

from dataclasses import dataclass

import torch

from primerl.trainer.config import LossConfig
from primerl.trainer.logprobs import TokenScores


@dataclass
class LossParts:
    loss: torch.Tensor  # this micro-batch's share of the global loss (already divided by N)
    mismatch_kl_sum: float
    masked_tokens: int
    entropy_sum: float
    tokens: int

    def sums(self) -> dict[str, float]:
        """What the trainer adds up over micro-batches and ranks."""
        return {
            "mismatch_kl": self.mismatch_kl_sum,
            "masked": self.masked_tokens,
            "entropy": self.entropy_sum,
            "tokens": self.tokens,
        }


def policy_loss(scores: TokenScores, micro: dict[str, torch.Tensor], total_tokens: int, cfg: LossConfig) -> LossParts:
    """`scores` at the batch's sampling temperature (primerl.trainer.logprobs)."""
    mask = micro["loss_mask"][:, 1:]
    logp = scores.logprobs[:, :-1]
    log_ratio = logp - micro["inference_logprobs"][:, 1:]
    ratio = torch.exp(log_ratio)
    in_region = (ratio.detach() >= cfg.mask_ratio_low) & (ratio.detach() <= cfg.mask_ratio_high)
    keep = mask & in_region
    advantages = micro["advantages"][:, 1:]
    loss = -(ratio * advantages * keep).sum() / max(total_tokens, 1)
    with torch.no_grad():
        lr64 = log_ratio.double()[mask]  # fp32 underflows: inference and trainer agree to ~1e-6 on CPU
        kl = (torch.exp(lr64) - 1 - lr64).sum().item()
        entropy = scores.entropy[:, :-1][mask].sum().item()
    return LossParts(loss, kl, int((mask & ~in_region).sum()), entropy, int(mask.sum()))
