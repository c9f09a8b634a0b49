"""The RL trainer on 1 and 2 gloo ranks (FSDP2, and FSDP2 + expert parallel for the MoE model) trains the same
batch to the same loss, gradient norm and weights."""

import pytest
import torch
from safetensors.torch import load_file

from primerl.app import check
from primerl.metrics import read_metrics
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.batch import build_batch
from primerl.transport.batches import write_rollout_batch
from primerl.transport.run_dir import weights_path
from tests.conftest import model_samples, run_module

pytestmark = pytest.mark.slow


MEMORY_SAVERS = ("trainer.activation_checkpointing=true", "trainer.logprob_chunk_size=7")


# a sequence-level loss and reduction: each rank must see every sequence's whole length and the global count
ALGORITHM = (
    "trainer.loss.type=gspo",
    "trainer.loss.reduction=sequence",
    "trainer.loss.clip_ratio_high=1.0004",
    "trainer.loss.kl_coef=0.1",  # a frozen, sharded reference copy of the start model
    "trainer.loss.off_policy.correction=tis",  # a per-sequence IS weight; its max is reduced with max over ranks
    "trainer.loss.off_policy.level=geometric",
)


# routing replay: every token routed to experts fixed by its position, not the router's choice
# (primerl/trainer/routing_replay.py)
REPLAY = "trainer.moe.routing_replay=true"


def forced_routes(micro: dict, layers: int, experts: int) -> torch.Tensor:
    """Routes for every position of `micro`: experts (t + layer) % E and (t + layer + 1) % E."""
    rows, length = micro["input_ids"].shape
    t = torch.arange(length).view(1, length, 1).expand(rows, length, layers) + torch.arange(layers)
    return torch.stack([t % experts, (t + 1) % experts], -1)


@pytest.mark.parametrize(
    "model,parallelism,savers,algorithm",
    [
        ("tiny", "fsdp2", (), ALGORITHM),
        ("tiny_moe", "fsdp2_ep", (), (REPLAY,)),
        ("tiny", "fsdp2_cp", MEMORY_SAVERS, ("trainer.loss.reduction=sequence",)),
        ("tiny", "fsdp2_cp", MEMORY_SAVERS, ("model.lora.rank=8", "trainer.optim.lr=3e-3")),
    ],
)
def test_trainer_one_rank_equals_two_ranks(cache_dir, tmp_path, model, parallelism, savers, algorithm):
    """fsdp2: parameters sharded over 2 ranks, micro-batches split; fsdp2_ep: the MoE experts split 2+2 over the
    ranks, tokens sent to them by all-to-all, each token to the experts its batch replays (routing replay);
    fsdp2_cp: every packed row split in two halves, attention over the all-gathered keys and values, and on top
    each decoder layer's activations recomputed in the backward and the tokens scored 7 at a time. The 1-rank run
    is the plain model in every case (its micro-batches of 128 tokens scored in one chunk: the full-vocabulary
    path). With fsdp2 the loss is GSPO's, reduced per sequence, with a KL to the reference and a truncated
    geometric-mean IS correction; with fsdp2_cp the default loss reduced per sequence, whose sequences straddle the
    CP split; and fsdp2_cp again with LoRA adapters, the only parameters that train and that are published."""
    args = [
        "+experiment=reverse_text",
        "sft.enabled=false",
        "trainer.max_steps=1",
        f"cache_dir={cache_dir}",
        f"model={model}",
        *algorithm,
    ]
    cfg = check([*args, f"output_dir={tmp_path}"])
    lora = cfg.model.lora.enabled
    samples = model_samples(prepare_base_model(cfg.model, cfg.cache_dir))
    batch = build_batch(samples, 0, seq_len=128, micro_batch_size=1, pad_id=0, temperature=1.0, async_level=1)
    while len(batch.micro_batches) % 2 == 0:  # make the count odd
        samples = samples[:-1]
        batch = build_batch(samples, 0, seq_len=128, micro_batch_size=1, pad_id=0, temperature=1.0, async_level=1)
    assert len(batch.micro_batches) % 2 == 1  # with fsdp2, rank 1 also runs a loss-free padding pass
    # with fsdp2_cp, documents cross the split point of a row
    assert any(mb["position_ids"][0, 64] != 0 for mb in batch.micro_batches)
    replay = REPLAY in algorithm
    if replay:  # the routes travel in the batch; the model's own log-probs were scored with its own routing
        for mb in batch.micro_batches:
            mb["routed_experts"] = forced_routes(mb, cfg.model.arch.num_hidden_layers, cfg.model.arch.num_experts)
    rows, weights = {}, {}
    for nproc in (1, 2):
        run = tmp_path / f"np{nproc}"
        write_rollout_batch(run, batch)
        layout = [f"parallelism={parallelism}", *savers] if nproc > 1 else []
        result = run_module(
            "primerl.entrypoints.trainer",
            *args,
            *layout,
            f"output_dir={run}",
            f"hydra.run.dir={run}/logs",
            torchrun=nproc,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (rows[nproc],) = read_metrics(run, "trainer")
        published = weights_path(run, 1)
        weights[nproc] = load_file(published / ("adapter_model.safetensors" if lora else "model.safetensors"))
    if replay:  # the trainer ran the batch's experts, not its own: another policy than the one that scored it
        assert rows[1]["mismatch_kl"] > 1e-4 and rows[1]["moe/replayed_fraction"] == 1.0
        assert rows[2]["mismatch_kl"] == pytest.approx(rows[1]["mismatch_kl"], rel=1e-5)
        assert rows[2]["moe/replayed_fraction"] == 1.0
    else:
        assert rows[1]["mismatch_kl"] < 1e-10  # the batch's logprobs are the model's own
    if algorithm == ALGORITHM:  # before the first update the policy is its reference
        assert rows[1]["reference_kl"] < 1e-12 and rows[2]["reference_kl"] < 1e-12
        for key in ("off_policy/is_weight_mean", "off_policy/is_weight_max"):  # the model's own samples: ~1
            assert rows[2][key] == pytest.approx(rows[1][key], rel=1e-5) and rows[1][key] == pytest.approx(1, abs=1e-3)
    else:
        assert "reference_kl" not in rows[1]
    for key in ("loss", "grad_norm", "entropy"):
        assert rows[2][key] == pytest.approx(rows[1][key], rel=1e-5), key
    assert rows[1]["grad_norm"] > 0
    base = load_file(f"{prepare_base_model(cfg.model, cfg.cache_dir)}/model.safetensors")
    # AdamW's first step divides each gradient by its own magnitude (plus eps 1e-8), so an element whose gradient is
    # near eps turns the reduction order's rounding into up to ~1e-6 of its 1e-4 update: 3 of ~0.8M elements moved
    # 1.2e-6 to 2.5e-6 apart with fsdp2_cp. A wrong shard or gather moves whole tensors by ~1e-4.
    for name, value in weights[1].items():
        torch.testing.assert_close(weights[2][name], value, rtol=0, atol=1e-5, msg=name)
    if lora:  # the adapters alone were published: every B moved off zero, every A kept (its gradient is B's, 0)
        start = load_file(weights_path(tmp_path / "np1", 0) / "adapter_model.safetensors")
        assert weights[1].keys() == start.keys()
        assert all(torch.equal(weights[1][k], start[k]) == (".lora_A." in k) for k in start)
        return
    unchanged = [name for name, value in weights[1].items() if torch.equal(value, base[name])]
    assert all(".experts." in name for name in unchanged), unchanged  # only an expert no token chose keeps still
    assert len(unchanged) < len(weights[1]) / 4
