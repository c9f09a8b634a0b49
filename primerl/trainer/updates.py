"""Several optimizer steps per batch (`trainer.mini_batches`, `trainer.epochs`).

The batch's packed micro-batches are split, in order, into `mini_batches` contiguous parts (sizes differing by at
most one); each part is one optimizer step, and the parts are passed over `epochs` times: mini_batches x epochs
steps per batch. Every rank splits the same global list the same way, then takes its share of each part
(`rank_micro_batches`), so every rank runs each step with the same number of passes.

A step's loss is normalised by its own part (the sampled tokens and sequences of the part's micro-batches, over all
ranks), so each step is the mean over its part, as one step on the whole batch is the mean over the batch.

The proximal policy. From the second step on, pi_theta has moved off the policy the batch met. With several steps
the trainer scores every micro-batch once, without gradient, before the first step (`proximal_logprobs`: one more
forward per micro-batch and batch); the mismatch KL is measured against it. With an off-policy correction
(`trainer.loss.off_policy`) the loss types' ratio is taken against it too, so the clips of ppo_clip, gspo and cispo
engage as pi_theta moves, and the IS weight compares it with the inference policy. Without a correction the ratio
stays against the inference log-probs, each step. With one step per batch nothing changes: the proximal policy is
the trainer's at that step (primerl.trainer.off_policy).
"""

import torch

from primerl.metrics import TrainerMetric
from primerl.trainer.dist import MAX_SUFFIX
from primerl.trainer.loss import BatchTotals
from primerl.trainer.loss_terms import segments
from primerl.trainer.trainer import StepResult


def split_parts(micro: list[dict], parts: int) -> list[list[dict]]:
    """`micro` in `parts` contiguous parts of near-equal length (fewer when there are fewer micro-batches)."""
    parts = max(1, min(parts, len(micro)))
    size, extra = divmod(len(micro), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(micro[start:end])
        start = end
    return out


def rank_micro_batches(micro: list[dict], dp_rank: int, dp: int) -> list[dict]:
    """This data-parallel rank's share, padded with loss-free copies so every rank runs ceil(len/dp) passes."""
    per_rank = -(-len(micro) // dp)
    mine = micro[dp_rank::dp]
    while len(mine) < per_rank:
        mine.append({**micro[0], "loss_mask": torch.zeros_like(micro[0]["loss_mask"])})
    return mine


def part_totals(part: list[dict], constant_tokens: int) -> BatchTotals:
    """The loss normalisers of one part: its sampled tokens (the first of a row never counts) and its sequences
    with a sampled token."""
    tokens = int(sum(mb["loss_mask"][:, 1:].sum() for mb in part))
    sequences = 0
    for mb in part:
        segment = segments(mb["position_ids"])
        for row in range(segment.shape[0]):
            sequences += len(torch.unique(segment[row][mb["loss_mask"][row]]))
    return BatchTotals(tokens, sequences, constant_tokens)


def update_metrics(first_pass: list[StepResult], every: list[StepResult]) -> dict[str, float]:
    """The metrics row of a batch's updates (train_on_batch)."""
    sums = {key: sum(r.sums[key] for r in first_pass) for key in first_pass[0].sums if not key.endswith(MAX_SUFFIX)}
    tokens = max(sums["tokens"], 1.0)
    row = {
        TrainerMetric.LOSS: sum(r.sums["loss"] for r in every) / len(every),
        TrainerMetric.MISMATCH_KL: sums["mismatch_kl"] / tokens,
        TrainerMetric.MASKED_FRACTION: sums["masked"] / tokens,
        TrainerMetric.CLIPPED_FRACTION: sum(r.sums["clipped"] for r in every)
        / max(sum(r.sums["tokens"] for r in every), 1.0),
        TrainerMetric.ENTROPY: sums["entropy"] / tokens,
        TrainerMetric.GRAD_NORM: sum(r.grad_norm for r in every) / len(every),
        TrainerMetric.FORWARD_S: sum(r.forward_s for r in every),
        TrainerMetric.BACKWARD_S: sum(r.backward_s for r in every),
        TrainerMetric.OPTIMIZER_S: sum(r.optimizer_s for r in every),
        TrainerMetric.UPDATE_SKIPPED: float(sum(not r.applied for r in every)) / len(every),
    }
    if "reference_kl" in sums:  # the trainer has a reference policy
        row[TrainerMetric.REFERENCE_KL] = sums["reference_kl"] / tokens
    if "is_weight" in sums:  # an off-policy correction
        row[TrainerMetric.IS_WEIGHT_MEAN] = sums["is_weight"] / tokens
        row[TrainerMetric.IS_WEIGHT_MAX] = max(r.sums["is_weight_max"] for r in first_pass)
        row[TrainerMetric.CORRECTED_FRACTION] = sums["corrected"] / tokens
    if "replayed" in sums:  # routing replay
        row[TrainerMetric.REPLAYED_FRACTION] = sums["replayed"] / tokens
    return row
