"""Turn a cut of samples into the trainer's batch: pack into rows, split into micro-batches."""

from primerl.transport.batches import RolloutBatch, Sample
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
    advantage on every token, plus its `token_advantages` where it has them; only masked tokens use it).
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
