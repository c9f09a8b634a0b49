"""The RL loss: per-token terms of the chosen type (primerl.trainer.loss_terms), a trust-region mask, a reduction.

For every sampled token t (loss_mask) of every sequence i in the global batch, with r_t = pi_theta(y_t) /
pi_inf(y_t) the trainer's probability over the inference policy's (which sampled, possibly some versions ago and
with different numerics):

    m_t   = 1 if mask_ratio_low <= r_t <= mask_ratio_high else 0            # tokens outside the region: no loss
    loss  = sum_t w_t * m_t * term_t                                        # term_t: trainer.loss.type

plus, with a reference policy pi_ref (the run's starting policy: `trainer.loss.kl_coef` > 0),

    kl_coef * sum_t w_t * m_t * (exp(q_t) - q_t - 1),   q_t = log pi_ref(y_t) - log pi_theta(y_t)

(the k3 estimator of KL(pi_theta || pi_ref), >= 0, logged as reference_kl per sampled token). With an off-policy
correction (`trainer.loss.off_policy`, primerl.trainer.off_policy) each term is computed against the trainer's own
policy at this pass and multiplied by the token's corrected IS weight c_t, and m_t also drops the tokens the
correction masks. The weights w_t are `trainer.loss.reduction`:

    token     w_t = 1 / N                       N = sampled tokens of the global batch (primerl's default)
    sequence  w_t = 1 / (S * |y_i|)             S = sequences of the global batch, |y_i| = sampled tokens of i
    constant  w_t = 1 / (S * L)                 Dr.GRPO's constant normaliser, L = trainer.loss.constant_tokens
                                                (default: orchestrator.max_tokens)

N and S count every sampled token and sequence of the global batch, masked or not, so the gradient of 1 rank
equals that of N ranks. With the default type (is_pg) and reduction (token) the gradient is
-(1/N) sum_t m_t r_t A_t grad log pi_theta(y_t): the policy gradient re-weighted from the inference policy to the
trainer's. Logged for every type: mismatch KL = mean_t (r_t - 1 - log r_t) (k3 estimator of KL(pi_inf ||
pi_theta)), the masked fraction, and the policy's entropy on sampled positions.
"""

from dataclasses import dataclass

import torch

from primerl.config.trainer import REDUCTIONS, LossConfig
from primerl.trainer.logprobs import TokenScores
from primerl.trainer.loss_terms import per_sequence, segments, token_terms
from primerl.trainer.off_policy import correct, importance_weights
from primerl.utils.errors import ConfigError

CLIPPED_TYPES = ("ppo_clip", "gspo", "cispo")
PROXIMAL = "proximal_logprobs"  # a micro-batch's log-probs under the policy before the batch's first update, [B, T]


@dataclass
class LossParts:
    loss: torch.Tensor  # this micro-batch's share of the global loss (already divided by N)
    mismatch_kl_sum: float
    masked_tokens: int
    entropy_sum: float
    tokens: int
    clipped_tokens: int = (
        0  # ppo_clip, gspo, cispo: sampled tokens whose ratio (gspo: its sequence's) is outside the clip
    )
    reference_kl_sum: float | None = None  # with a reference policy: sum over sampled tokens of k3(pi_theta, pi_ref)
    off_policy: dict[str, float] | None = None  # with a correction (primerl.trainer.off_policy): its sums

    def sums(self) -> dict[str, float]:
        """What the trainer adds up over micro-batches and ranks."""
        sums = {
            "mismatch_kl": self.mismatch_kl_sum,
            "masked": self.masked_tokens,
            "entropy": self.entropy_sum,
            "tokens": self.tokens,
            "clipped": self.clipped_tokens,
        }
        if self.reference_kl_sum is not None:
            sums["reference_kl"] = self.reference_kl_sum
        return sums | (self.off_policy or {})


@dataclass(frozen=True)
class BatchTotals:
    """The global batch's normalisers (RolloutBatch.num_loss_tokens, num_samples; constant_tokens: L above)."""

    tokens: int
    sequences: int = 1
    constant_tokens: int = 1


def with_sequence_tokens(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`micro` plus "sequence_tokens": per token, the sampled tokens of its sequence (the sequence reduction's
    |y_i|). Computed on whole rows, before context parallel splits them."""
    mask = micro["loss_mask"].clone()
    mask[:, 0] = False  # the first token of a row is never predicted
    counts = per_sequence(mask.to(torch.float32), segments(micro["position_ids"]))
    return {**micro, "sequence_tokens": counts}


def reduction_weights(reduction: str, micro: dict[str, torch.Tensor], totals: BatchTotals) -> torch.Tensor:
    """w_t of the module docstring, [B, T-1] (aligned with the shifted loss mask)."""
    if reduction == "token":
        return torch.full_like(micro["inference_logprobs"][:, 1:], 1.0 / max(totals.tokens, 1))
    if reduction == "sequence":
        return 1.0 / (micro["sequence_tokens"][:, 1:].clamp(min=1) * max(totals.sequences, 1))
    if reduction == "constant":
        return torch.full_like(
            micro["inference_logprobs"][:, 1:], 1.0 / (max(totals.sequences, 1) * totals.constant_tokens)
        )
    raise ConfigError(
        "trainer.loss.reduction", f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}"
    )


def policy_loss(
    scores: TokenScores, micro: dict[str, torch.Tensor], totals: BatchTotals | int, cfg: LossConfig
) -> LossParts:
    """`scores` at the batch's sampling temperature (primerl.trainer.logprobs); `totals`: the global batch's
    normalisers (an int: the token count, enough for the token reduction). The sequence reduction needs
    `with_sequence_tokens(micro)`."""
    if isinstance(totals, int):
        totals = BatchTotals(totals)
    mask = micro["loss_mask"][:, 1:]
    logp = scores.logprobs[:, :-1]
    inference = micro["inference_logprobs"][:, 1:]
    log_ratio = logp - inference
    ratio = torch.exp(log_ratio.detach())
    in_region = (ratio >= cfg.mask_ratio_low) & (ratio <= cfg.mask_ratio_high)
    keep = mask & in_region
    off = cfg.off_policy
    whole_sequences = cfg.type == "gspo" or (off.correction != "none" and off.level != "token")
    segment = segments(micro["position_ids"])[:, 1:] if whole_sequences else None
    clip = (cfg.clip_ratio_low, cfg.clip_ratio_high)
    behaviour, correction = inference, None
    if off.correction != "none":  # the loss type against the trainer's own policy; the IS weight enters through c_t
        # the proximal policy: the trainer's before this batch's first update (primerl.trainer.updates), else now
        behaviour = micro[PROXIMAL][:, :-1] if PROXIMAL in micro else logp.detach()
        correction = correct(off, behaviour - inference, mask, segment)
        keep = keep & correction.keep
    terms = token_terms(cfg.type, logp, behaviour, micro["advantages"][:, 1:], mask, segment, clip, cfg.custom)
    if correction is not None:
        terms = terms * correction.weights
    clipped = 0
    if cfg.type in CLIPPED_TYPES:
        level = "geometric" if cfg.type == "gspo" else "token"
        clip_ratio = importance_weights(level, (logp.detach() - behaviour).double(), mask, segment)
        clipped = int((((clip_ratio < clip[0]) | (clip_ratio > clip[1])) & mask).sum())
    weights = reduction_weights(cfg.reduction, micro, totals)
    loss = (torch.where(keep, terms, 0.0) * weights).sum()
    reference_kl = None
    if scores.reference is not None:
        to_reference = scores.reference[:, :-1] - logp
        kl_terms = torch.exp(to_reference) - to_reference - 1  # k3: >= 0, unbiased for KL(pi_theta || pi_ref)
        loss = loss + cfg.kl_coef * (torch.where(keep, kl_terms, 0.0) * weights).sum()
        reference_kl = kl_terms.detach()[mask].double().sum().item()
    with torch.no_grad():  # the mismatch of the policy before this batch's updates (all one with a single update)
        proximal = micro[PROXIMAL][:, :-1] - inference if PROXIMAL in micro else log_ratio
        lr64 = proximal.double()[mask]  # fp32 underflows: inference and trainer agree to ~1e-6 on CPU
        kl = (torch.exp(lr64) - 1 - lr64).sum().item()
        entropy = scores.entropy[:, :-1][mask].sum().item()
    off_policy = correction.sums if correction is not None else None
    masked = int((mask & ~in_region).sum())
    return LossParts(loss, kl, masked, entropy, int(mask.sum()), clipped, reference_kl, off_policy)
