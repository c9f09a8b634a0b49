"""Several optimizer steps per batch (primerl.trainer.updates): how a batch is split over steps and ranks, the
normalisers of each part, and a real trainer run whose later updates move the policy off the proximal one, so the
PPO clip engages."""

import pytest
import torch

from primerl.app import check
from primerl.metrics import read_metrics
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.batch import build_batch
from primerl.trainer.updates import part_totals, rank_micro_batches, split_parts
from primerl.transport.batches import write_rollout_batch
from tests.conftest import model_samples, run_module


def test_a_batch_splits_into_near_equal_parts_whose_normalisers_add_up(cache_dir):
    micro = list(range(7))
    assert [len(p) for p in split_parts(micro, 3)] == [3, 2, 2] and sum(split_parts(micro, 3), []) == micro
    assert split_parts(micro[:2], 5) == [[0], [1]]  # never an empty part
    cfg = check(["+experiment=reverse_text", f"cache_dir={cache_dir}"])
    samples = model_samples(prepare_base_model(cfg.model, cfg.cache_dir), n=12)
    batch = build_batch(samples, 0, seq_len=128, micro_batch_size=2, pad_id=0, temperature=1.0, async_level=1)
    parts = split_parts(batch.micro_batches, 3)
    totals = [part_totals(part, 10) for part in parts]
    assert sum(t.tokens for t in totals) == batch.num_loss_tokens
    assert sum(t.sequences for t in totals) == batch.num_samples == 12
    # every rank runs each part with the same number of passes, padding with loss-free ones
    shares = [rank_micro_batches(parts[0], rank, 2) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) and not shares[1][-1]["loss_mask"].any() == (len(parts[0]) % 2 == 1)


@pytest.mark.slow
def test_later_updates_of_a_batch_engage_the_clip_against_the_proximal_policy(cache_dir, tmp_path):
    """ppo_clip with a truncated-IS correction, the batch in 2 parts over 2 epochs: 4 AdamW steps on one batch. The
    first pass sees the model's own log-probs (mismatch KL ~0, IS weights 1, nothing clipped); the later updates
    move the policy, and their ratios against the proximal policy leave the clip range."""
    args = [
        "+experiment=reverse_text",
        "sft.enabled=false",
        "trainer.max_steps=1",
        f"cache_dir={cache_dir}",
        "trainer.loss.type=ppo_clip",
        "trainer.loss.off_policy.correction=tis",
        "trainer.mini_batches=2",
        "trainer.epochs=2",
        "trainer.optim.lr=1e-2",
        f"output_dir={tmp_path}",
        f"hydra.run.dir={tmp_path}/logs",
    ]
    cfg = check(args)
    samples = model_samples(prepare_base_model(cfg.model, cfg.cache_dir), n=16)
    write_rollout_batch(
        tmp_path, build_batch(samples, 0, seq_len=128, micro_batch_size=2, pad_id=0, temperature=1.0, async_level=1)
    )
    result = run_module("primerl.entrypoints.trainer", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_metrics(tmp_path, "trainer")
    assert row["mismatch_kl"] < 1e-6 and row["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert row["off_policy/corrected_fraction"] == 0.0  # no weight above the cap at the first pass
    assert 0.05 < row["clipped_fraction"] < 1.0, row  # 3 of the 4 updates are off the proximal policy
    assert row["update_skipped"] == 0.0 and torch.isfinite(torch.tensor(row["loss"]))
