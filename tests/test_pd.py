"""Prefill/decode disaggregation on real vLLM-CPU servers: ExampleConnector carries each prompt's KV through a
directory of the run from the prefill to the decode server, and primerl's router puts both behind one address."""

import asyncio
import json
import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.pd import cpu_pd_overrides
from primerl.app import check
from primerl.inference.engine_support import check_supported
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.inference_client import InferenceClient
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.identity import SERVER_ID_HEADER, server_identity
from primerl.transport.run_dir import pd_kv_store, weights_path
from primerl.transport.weights import SERVED_MODEL_NAME
from primerl.utils.errors import ConfigError
from primerl.utils.process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-server")]


def _generate(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "model": SERVED_MODEL_NAME,
        "token_ids": prompt,
        "sampling_params": {"max_tokens": 12, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def _completion_body(prompt: list[int]) -> dict:
    return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _completion(url: str, prompt: list[int]) -> str:
    r = httpx.post(f"{url}/v1/completions", json=_completion_body(prompt), timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _streamed(url: str, prompt: list[int]) -> list[str]:
    """The text pieces of a streamed completion, in order."""
    body = {**_completion_body(prompt), "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(event)["choices"][0]["text"] for event in events if event != "[DONE]"]


@torch.no_grad()
def _greedy(model_dir, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` (12 tokens) and each chosen token's log-prob."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids, logprobs = torch.tensor([prompt]), []
    for _ in range(12):
        scores = model(ids).logits[0, -1].log_softmax(-1)
        logprobs.append(float(scores.max()))
        ids = torch.cat([ids, scores.argmax().view(1, 1)], 1)
    return ids[0, len(prompt) :].tolist(), logprobs


def test_prefill_and_decode_through_the_router_serve_what_the_model_computes_and_follow_an_update(cache_dir, tmp_path):
    """A prefill and a decode server behind the router, served as `primerl eval` serves a run with
    `inference.pd.enabled` (primerl.eval's `served_at`): greedy token ids and log-probs as transformers computes them,
    the prompt's KV carried from prefill to decode (plain and streamed), an update that reaches both servers and
    empties the KV store, and nothing of the store left once the serving ends."""
    from primerl.entrypoints.eval import served_at

    ports = [free_port() for _ in range(3)]
    pd = cpu_pd_overrides(ports)
    common = ["+experiment=reverse_text", "sft.enabled=false", f"cache_dir={cache_dir}", f"output_dir={tmp_path}"]
    cfg = check([*common, *pd])
    check_supported(cfg.inference, "cpu")
    with pytest.raises(ConfigError, match="inference.pd.kv_connector"):
        check_supported(check([*common, "inference.pd.enabled=true"]).inference, "cpu")  # NixlConnector: GPUs
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.encode("<|im_start|>user\n" + "abcdefghij" * 12 + "<|im_end|>\n<|im_start|>assistant\n")
    decode_log = tmp_path / "logs" / f"vllm-{ports[2]}.log"
    with served_at(cfg, model, "cpu", None) as url:
        assert url == f"http://127.0.0.1:{ports[0]}"
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200 and health.headers[SERVER_ID_HEADER] == server_identity(tmp_path)
        ids, logprobs = _generate(url, prompt)
        expected_ids, expected_logprobs = _greedy(model, prompt)
        assert ids == expected_ids and logprobs == pytest.approx(expected_logprobs, abs=1e-4)
        assert any(pd_kv_store(tmp_path, 0).iterdir())  # the prefill server stored the prompt's KV...
        assert len(re.findall("External Cache Hit", decode_log.read_text())) == 1  # ...and decode loaded it
        chunks = _streamed(url, prompt)
        assert len(chunks) > 1 and "".join(chunks) == _completion(url, prompt)  # streamed and whole through PD
        assert len(re.findall("External Cache Hit", decode_log.read_text())) == 3

        state = AutoModelForCausalLM.from_pretrained(model).state_dict()
        torch.manual_seed(1)
        moved = {k: v + 0.05 * torch.randn_like(v) if v.dim() == 2 else v for k, v in state.items()}
        moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
        new_dir = save_hf_checkpoint(moved, model, weights_path(tmp_path, 1))

        async def update() -> int:
            async with InferenceClient(url) as client:
                await client.load_weights(new_dir, 1)
                return await client.policy_version()  # both servers' workers, or an error

        assert asyncio.run(update()) == 1
        assert not any(pd_kv_store(tmp_path, 0).iterdir())  # the old weights' KV went with the pause
        ids, _ = _generate(url, prompt)
        assert ids == _greedy(new_dir, prompt)[0] != expected_ids
        _generate(url, prompt)
        assert any(pd_kv_store(tmp_path, 0).iterdir())
    assert not any(pd_kv_store(tmp_path, 0).iterdir())  # an eval has no update: the store goes when serving ends


def test_a_short_rl_run_goes_through_two_prefill_decode_pairs(cache_dir, tmp_path):
    """`primerl.train` with `inference.pd.enabled` and two replicas: the inference process starts two prefill/decode
    pairs and a router in front of each at inference.port + i; the orchestrator spreads rollouts over the routers;
    every rollout's KV crosses from its pair's prefill to its decode server; new policies reach all four servers;
    step 0 trains on the trainer's own log-probs as with one server. (`primerl eval` serves through a pair and its
    router as the test above does.)"""
    from primerl.metrics import read_metrics
    from tests.conftest import run_module

    run, servers = tmp_path / "run", free_port(count=4)  # prefill ports, then decode ports
    result = run_module(
        "primerl.train",
        "+experiment=reverse_text",
        "sft.enabled=false",
        *cpu_pd_overrides([0, servers, servers + 2]),  # the routers on free ports
        "inference.replicas=2",
        "trainer.max_steps=3",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        f"cache_dir={cache_dir}",
        f"hydra.run.dir={run}",
        "ledger.enabled=false",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert len(re.findall(r"routed at http://127\.0\.0\.1:", (run / "logs" / "inference.log").read_text())) == 2
    trainer = read_metrics(run, "trainer")
    assert [r["step"] for r in trainer] == [0, 1, 2] and trainer[0]["mismatch_kl"] < 1e-4
    assert re.search(r"policy v\d -> v3 loaded in flight", (run / "logs" / "orchestrator.log").read_text())
    decode_logs = [p.read_text() for p in (run / "logs").glob("vllm-*.log") if "kv_consumer" in p.read_text()]
    hits = [text.count("External Cache Hit") for text in decode_logs]
    assert len(hits) == 2 and min(hits) >= 4 and sum(hits) >= 16, hits  # each pair's decode server loaded prompts' KV
    assert {p.name for p in (run / "pd_kv").iterdir()} == {"0", "1"}  # each pair its own store...
    assert not any(any(store.iterdir()) for store in (run / "pd_kv").iterdir())  # ...emptied when the run ended
