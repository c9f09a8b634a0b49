"""Turn a cut of samples into the trainer's batch: pack into rows, split into micro-batches."""

import numpy as np

from primerl.transport.batches import NO_ROUTE, ROUTES_FIELD, RolloutBatch, Sample
from primerl.transport.packing import pack_sequences


def build_batch(
    samples: list[Sample],
    step: int,
    seq_len: int,
    micro_batch_size: int,
    pad_id: int,
    *,
    temperature: float,
    async_level: int,
    metrics: dict[str, float] | None = None,
    data_position: int = 0,
) -> RolloutBatch:
    """Pack samples into rows of `seq_len`, then micro-batches of `micro_batch_size` rows. `temperature` and
    `async_level` say how the samples were drawn (the trainer's loss matches them).

    Per-token fields: `loss_mask` (sampled tokens), `inference_logprobs`, and `advantages` (the sample's
    advantage on every token, plus its `token_advantages` where it has them; only masked tokens use it). When any
    sample carries routed experts, `routed_experts` [rows, seq_len, moe_layers, k]: theirs at their tokens, -1 (the
    trainer's router routes) at every other position.
    """
    if not samples:
        raise ValueError(f"no samples left for step {step}")
    sequences = [
        {
            "input_ids": s.token_ids,
            "loss_mask": s.sampled_mask,
            "inference_logprobs": s.logprobs,
            "advantages": (
                [s.advantage] * len(s.token_ids)
                if s.token_advantages is None
                else [s.advantage + extra for extra in s.token_advantages]
            ),
        }
        for s in samples
    ]
    pad = {"input_ids": pad_id, "loss_mask": False, "inference_logprobs": 0.0, "advantages": 0.0}
    if (routes := _routes(samples)) is not None:
        for sequence, sample_routes in zip(sequences, routes, strict=True):
            sequence[ROUTES_FIELD] = sample_routes
        pad[ROUTES_FIELD] = NO_ROUTE
    rows = pack_sequences(sequences, seq_len, pad)
    micro = [
        {k: v[i : i + micro_batch_size] for k, v in rows.items()}
        for i in range(0, rows["input_ids"].shape[0], micro_batch_size)
    ]
    # the first token of a row is never predicted (no previous token), so it never counts
    num_loss_tokens = int(sum(mb["loss_mask"][:, 1:].sum() for mb in micro))
    return RolloutBatch(
        step=step,
        micro_batches=micro,
        num_samples=len(samples),
        num_loss_tokens=num_loss_tokens,
        min_policy_version=min(s.policy_version for s in samples),
        temperature=temperature,
        async_level=async_level,
        metrics=dict(metrics or {}),
        data_position=data_position,
    )


def _routes(samples: list[Sample]) -> list[np.ndarray] | None:
    """Each sample's routed experts, [tokens, moe_layers, k] (NO_ROUTE for a sample without them), or None when no
    sample has any. Samples whose routes have another shape than the first one's are refused: one model routed them."""
    given = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not given:
        return None
    shape = given[0].shape[1:]
    if any(r.shape[1:] != shape for r in given):
        raise ValueError(f"routed experts of shapes {sorted({r.shape[1:] for r in given})}: one model routes them all")
    return [
        s.routed_experts if s.routed_experts is not None else np.full((len(s.token_ids), *shape), NO_ROUTE)
        for s in samples
    ]
