"""Advantages, RL batch packing, the loss against a hand computation, the batch wire format."""

import json
import math
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from primerl.config.trainer import LossConfig
from primerl.orchestrator.advantages import group_advantages
from primerl.orchestrator.batch import build_batch
from primerl.trainer.logprobs import full_scores, next_tokens
from primerl.trainer.loss import policy_loss
from primerl.transport.batches import CorruptBatch, RolloutBatch, Sample, read_rollout_batch, write_rollout_batch
from primerl.transport.packing import pack_sequences
from primerl.transport.run_dir import rollout_path
from primerl.utils.errors import RunError


def _sample(n_prompt: int, n_completion: int, adv: float, version: int = 0, start: int = 1) -> Sample:
    ids = list(range(start, start + n_prompt + n_completion))
    mask = [False] * n_prompt + [True] * n_completion
    logprobs = [0.0] * n_prompt + [-0.5] * n_completion
    return Sample(ids, mask, logprobs, reward=adv, advantage=adv, policy_version=version)


def test_group_advantages_are_centered():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5])
    assert adv == [0.5, -0.5, 0.0, 0.0]
    assert sum(group_advantages([0.2, 0.9, 0.4])) == pytest.approx(0.0)
    assert group_advantages([0.7, 0.7]) == [0.0, 0.0]  # no signal in a uniform group
    assert group_advantages([]) == []


def test_build_batch_packing_invariants():
    samples = [_sample(5, 3, 0.5, start=10 * i) for i in range(7)]
    batch = build_batch(samples, step=3, seq_len=20, micro_batch_size=2, pad_id=0, temperature=1.0, async_level=1)
    assert batch.step == 3 and batch.num_samples == 7
    rows = torch.cat([mb["input_ids"] for mb in batch.micro_batches])
    assert rows.shape[1] == 20 and rows.shape[0] == 4  # 7 sequences of 8 tokens: 2 per row
    assert all(mb["input_ids"].shape[0] <= 2 for mb in batch.micro_batches)
    mask = torch.cat([mb["loss_mask"] for mb in batch.micro_batches])
    assert int(mask.sum()) == 7 * 3  # every sampled token, nothing else
    assert batch.num_loss_tokens == 7 * 3  # no sampled token sits first in a row
    adv = torch.cat([mb["advantages"] for mb in batch.micro_batches])
    assert torch.all(adv[mask] == 0.5)
    pos = torch.cat([mb["position_ids"] for mb in batch.micro_batches])
    assert int((pos == 0).sum()) >= 7  # each sequence restarts its positions
    with pytest.raises(ValueError, match="no samples"):
        build_batch([], step=0, seq_len=20, micro_batch_size=2, pad_id=0, temperature=1.0, async_level=1)


def test_packed_rows_hold_every_sequence_whole_with_its_own_positions():
    """Sequences of random lengths (one empty, one of a full row): read back from the rows by the positions, each
    field of each sequence is there whole, and everything else is padding."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(60)] + [0, 48]
    sequences = [
        {
            "input_ids": [rng.randint(1, 99) for _ in range(n)],
            "loss_mask": [rng.random() < 0.5 for _ in range(n)],
            "advantages": [round(rng.uniform(-1, 1), 2) for _ in range(n)],
        }
        for n in lengths
    ]
    pad = {"input_ids": 0, "loss_mask": False, "advantages": 0.0}
    rows = pack_sequences(sequences, 48, pad)
    assert rows["input_ids"].dtype == torch.long and rows["loss_mask"].dtype == torch.bool
    found, padding = [], 0
    for r in range(rows["input_ids"].shape[0]):
        starts = (rows["position_ids"][r] == 0).nonzero().flatten().tolist() + [48]
        for begin, end in zip(starts, starts[1:]):
            assert rows["position_ids"][r, begin:end].tolist() == list(range(end - begin))
            got = tuple(tuple(round(v, 2) for v in rows[key][r, begin:end].tolist()) for key in pad)
            if set(got[0]) == {0}:  # a row's padding: one more segment, fully masked
                assert not any(got[1]) and set(got[2]) == {0.0}
                padding += end - begin
            else:
                found.append(got)
    expected = [tuple(tuple(seq[key]) for key in pad) for seq in sequences if seq["input_ids"]]
    assert sorted(found) == sorted(expected)
    assert padding == rows["input_ids"].numel() - sum(lengths)


def test_packing_refuses_a_field_that_does_not_match_its_tokens():
    sequences = [{"input_ids": [1, 2], "loss_mask": [True, False]}, {"input_ids": [1, 2, 3], "loss_mask": [True, True]}]
    with pytest.raises(ValueError, match="sequence 1: loss_mask has 2 values for 3 tokens"):
        pack_sequences(sequences, 8, {"input_ids": 0, "loss_mask": False})


def test_loss_matches_hand_computation():
    torch.manual_seed(0)
    vocab, T = 7, 6
    logits = torch.randn(1, T, vocab, requires_grad=True)
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[False, False, False, True, True, True]])
    inf_lp = torch.tensor([[0.0, 0.0, 0.0, -1.0, -2.0, -30.0]])  # last token: ratio far above the region
    adv = torch.full((1, T), 0.7)
    micro = {"input_ids": input_ids, "loss_mask": mask, "inference_logprobs": inf_lp, "advantages": adv}
    cfg = LossConfig(mask_ratio_low=0.125, mask_ratio_high=8.0)
    parts = policy_loss(full_scores(logits, next_tokens(input_ids)), micro, 3, cfg)

    expected, kl, masked = 0.0, 0.0, 0
    logp_all = torch.log_softmax(logits.detach(), -1)
    for t in (3, 4, 5):  # token t is predicted from position t-1
        logp = logp_all[0, t - 1, input_ids[0, t]].item()
        ratio = math.exp(logp - inf_lp[0, t].item())
        kl += ratio - 1 - (logp - inf_lp[0, t].item())
        if 0.125 <= ratio <= 8.0:
            expected += -ratio * 0.7
        else:
            masked += 1
    expected /= 3
    assert parts.loss.item() == pytest.approx(expected, rel=1e-5)
    assert parts.masked_tokens == masked == 1
    assert parts.tokens == 3
    assert parts.mismatch_kl_sum == pytest.approx(kl, rel=1e-5)
    parts.loss.backward()
    assert logits.grad[0, 4].abs().sum() == 0  # the masked token's position gets no gradient
    assert logits.grad[0, 2].abs().sum() > 0


def test_zero_advantage_gives_zero_gradient():
    logits = torch.randn(1, 4, 5, requires_grad=True)
    micro = {
        "input_ids": torch.tensor([[1, 2, 3, 4]]),
        "loss_mask": torch.tensor([[False, True, True, True]]),
        "inference_logprobs": torch.full((1, 4), -1.6),
        "advantages": torch.zeros(1, 4),
    }
    scores = full_scores(logits, next_tokens(micro["input_ids"]))
    policy_loss(scores, micro, 3, LossConfig()).loss.backward()
    assert logits.grad.abs().sum() == 0


def test_rollout_batch_round_trip(tmp_path):
    samples = [_sample(4, 4, 0.25 * i, version=2, start=i) for i in range(5)]
    batch = build_batch(
        samples,
        step=7,
        seq_len=16,
        micro_batch_size=1,
        pad_id=0,
        temperature=0.7,
        async_level=3,
        metrics={"reward/mean": 0.4},
    )
    path = write_rollout_batch(tmp_path, batch)
    assert path == rollout_path(tmp_path, 7)
    assert not list(path.parent.glob(".primerl-tmp-*"))  # no temporary left behind
    back = read_rollout_batch(path)
    assert isinstance(back, RolloutBatch)
    assert (back.step, back.num_samples, back.num_loss_tokens, back.min_policy_version) == (7, 5, 20, 2)
    assert back.metrics == {"reward/mean": 0.4}
    assert (back.temperature, back.async_level) == (0.7, 3)  # what the trainer's loss must match travels with it
    for a, b in zip(batch.micro_batches, back.micro_batches, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key])
    # a batch that does not say how it was sampled is refused, not trained at a guessed temperature
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()["primerl"]), {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, path, metadata={"primerl": json.dumps({**meta, "step": 8})})
    with pytest.raises(CorruptBatch, match=r"its data or metadata does not match its recorded sha256"):
        read_rollout_batch(path)  # a header field changed: refused like a flipped byte
    del meta["temperature"]
    save_file(tensors, path, metadata={"primerl": json.dumps(meta)})
    with pytest.raises(RunError, match=r"records no temperature \(written by an older primerl\)"):
        read_rollout_batch(path)


def test_memoized_default_factory_check_keeps_pydantic_semantics():
    from pydantic import BaseModel, Field

    from primerl.envs.pydantic_memo import memoize_default_factory_check

    class Node(BaseModel):
        ids: list[int] = Field(default_factory=list)
        size: int = 3
        doubled: int = Field(default_factory=lambda data: 2 * data["size"])  # takes the validated data

    before = Node.model_construct(size=5)
    memoize_default_factory_check()
    memoize_default_factory_check()  # idempotent: one memo, not a memo of a memo
    for _ in range(3):  # answered from the memo after the first time
        after = Node.model_construct(size=5)
        assert (after.ids, after.doubled) == (before.ids, before.doubled) == ([], 10)
        assert after.ids is not Node.model_construct().ids  # still a fresh list per instance


def test_published_versions_outlive_every_policy_a_replica_may_be_asked_to_load(tmp_path):
    """Batch n is cut once policy n - async_level is served, and the trainer publishes v = n + 1 after training it: so
    while v is the newest, the orchestrator may still serve v - 1 - async_level, the version a replica coming back is
    told to load. Every async_level keeps it on disk (with a fixed 3 kept, async_level >= 2 lost it)."""
    from primerl.transport.atomic import STABLE_MARKER
    from primerl.transport.run_dir import weights_path
    from primerl.transport.weights import drop_old_version, versions_to_keep

    for async_level in range(6):
        run, keep = tmp_path / f"a{async_level}", versions_to_keep(async_level)
        for v in range(1, 20):
            weights_path(run, v).mkdir(parents=True)
            (weights_path(run, v) / STABLE_MARKER).touch()
            drop_old_version(run, v, keep)
            oldest_served = max(v - 1 - async_level, 1)
            assert all(weights_path(run, u).exists() for u in range(oldest_served, v + 1)), (async_level, v)
        assert not weights_path(run, 19 - keep).exists()  # and no more than that is kept


def test_a_full_disk_stalls_the_orchestrators_writes_and_loses_nothing(tmp_path, caplog):
    """A write that fails for a full disk (the kernel's ENOSPC, from /dev/full) is retried until there is space: the
    batch, its metrics row and its samples all arrive, each once; a line a killed writer tore stays the only bad one."""
    import threading

    from primerl.metrics import ORCHESTRATOR, read_metrics
    from primerl.orchestrator.writer import BatchWriter
    from primerl.transport.run_dir import samples_path

    samples = samples_path(tmp_path)
    samples.parent.mkdir(parents=True)
    samples.symlink_to("/dev/full")
    writer = BatchWriter(tmp_path, seq_len=20, micro_batch_size=2, pad_id=0, temperature=1.0, async_level=1)
    torn = tmp_path / "torn"
    torn.write_text('{"step": 0, "task": "to')
    # space comes back in one atomic step: an unlink then a write would let a retry in between
    space = threading.Timer(1.5, lambda: torn.replace(samples))
    space.start()
    with caplog.at_level("INFO", logger="primerl"):
        writer.write(0, [_sample(5, 3, 0.5)], {"reward/mean": 0.5}, data_position=4, examples=[{"step": 0, "i": 1}])
    space.join()
    assert "the sample rollouts of step 0: No space left on device" in caplog.text
    assert "the sample rollouts of step 0: written after" in caplog.text
    assert read_rollout_batch(rollout_path(tmp_path, 0)).data_position == 4
    assert [row["step"] for row in read_metrics(tmp_path, ORCHESTRATOR)] == [0]
    lines = samples.read_text().splitlines()
    assert lines == ['{"step": 0, "task": "to', '{"step": 0, "i": 1}']  # the torn line ended, the new one whole
