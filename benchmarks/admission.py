"""Admission by KV-cache pressure against fixed caps, on a deliberately small KV cache, alternating rounds.

    python -m benchmarks.admission [--rounds 2] [--steps 8] [--kv-blocks 48] [--caps 16 48 128]

Generation only (the inference process and the orchestrator, no trainer, async_level = steps: as where training has
devices of its own), `env=long_tail` (multi-turn: half the episodes one turn, a fifth --max-turns; each turn's
prompt holds the episode so far, so contexts grow), the random tiny model writing lowercase letters only (every
answer runs to --max-tokens), batch 64, group 8. vLLM's KV cache is cut to --kv-blocks blocks
(`--num-gpu-blocks-override`: vLLM-CPU's own knob, VLLM_CPU_KVCACHE_SPACE, cannot go below 1 GiB, a million tokens
of the tiny model), so the engine preempts well before the default cap. Per configuration, `orchestrator.admission=fixed`
with each --caps value as `orchestrator.max_inflight` (128 is the default), then `kv_pressure` (cap 256), in the same
order every round:
- samples/s: batches cut per second x batch size, after the first batch and before the last;
- preemptions: vLLM's `num_preemptions_total` at the end of the run;
- idle: the fraction of the orchestrator's polls that found the engine with no running request;
- limit: with kv_pressure, the sum of the replicas' limits at each cut (median, range).
Medians over rounds, with ranges.
"""

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from benchmarks.long_tail import CONTEXT_KEYS, LETTERS_ONLY, generate_only
from primerl.metrics import ORCHESTRATOR, read_metrics
from primerl.metrics import OrchestratorMetric as M
from primerl.utils.process import free_port

PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def run_overrides(args, admission: str, cap: int, run_dir: Path) -> list[str]:
    return [
        "+experiment=reverse_text",
        "env=long_tail",
        "sft.enabled=false",
        LETTERS_ONLY,
        f"trainer.max_steps={args.steps}",
        "orchestrator.batch_size=64",
        "orchestrator.group_size=8",
        f"orchestrator.async_level={args.steps}",
        f"orchestrator.max_off_policy_steps={args.steps}",
        f"orchestrator.max_tokens={args.max_tokens}",
        f"orchestrator.admission={admission}",
        f"orchestrator.max_inflight={cap}",
        f"env.args.max_turns={args.max_turns}",
        *[f"{key}={args.context}" for key in CONTEXT_KEYS],
        f"inference.port={free_port()}",
        f"inference.extra_args=[--num-gpu-blocks-override,{args.kv_blocks}]",
        "ledger.enabled=false",
        f"output_dir={run_dir}",
    ]


def one_run(args, admission: str, cap: int, run_dir: Path) -> dict[str, float]:
    overrides = run_overrides(args, admission, cap, run_dir)
    metrics = generate_only(overrides, run_dir, f"{admission} {cap}")
    rows = read_metrics(run_dir, ORCHESTRATOR)
    steady = rows[1:-1]  # after the first batch (warm-up), before the last (admission capped by max_steps)
    limits = [r[M.INFLIGHT_LIMIT] for r in steady if M.INFLIGHT_LIMIT in r]
    return {
        "samples_per_s": 64 * (len(rows) - 2) / (rows[-2]["time"] - rows[0]["time"]),
        "preemptions": sum(float(v) for v in PREEMPTIONS.findall(metrics)),
        "idle": statistics.mean(r[M.INFERENCE_IDLE] for r in steady if r.get(M.INFERENCE_IDLE) is not None),
        "limit": statistics.median(limits) if limits else float(cap),
        "limit_range": (min(limits), max(limits)) if limits else (cap, cap),
    }


def cell(runs: list[dict], key: str, fmt: str) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=48)
    parser.add_argument("--caps", type=int, nargs="+", default=[16, 48, 128])
    parser.add_argument("--max-tokens", type=int, default=24, help="per turn")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    configs = [("fixed", cap) for cap in args.caps] + [("kv_pressure", 256)]
    results: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="primerl-admission-") as tmp:
        for round_ in range(args.rounds):
            for admission, cap in configs:
                run_dir = Path(tmp) / f"r{round_}-{admission}-{cap}"
                print(f"round {round_ + 1}: {admission} max_inflight={cap} ...", flush=True)
                results[(admission, cap)].append(one_run(args, admission, cap, run_dir))
    print(f"\n{args.kv_blocks} KV blocks, {args.steps} batches of 64, medians over {args.rounds} rounds (range)")
    print(f"{'admission':>12} {'cap':>5} {'samples/s':>18} {'preemptions':>16} {'idle':>14} {'limit':>16}")
    for (admission, cap), runs in results.items():
        limits = f"{statistics.median(r['limit'] for r in runs):.0f}" + (
            f" ({min(r['limit_range'][0] for r in runs):.0f}-{max(r['limit_range'][1] for r in runs):.0f})"
            if admission == "kv_pressure"
            else ""
        )
        print(
            f"{admission:>12} {cap:>5} {cell(runs, 'samples_per_s', '.2f'):>18} {cell(runs, 'preemptions', '.0f'):>16} "
            f"{cell(runs, 'idle', '.0%'):>14} {limits:>16}"
        )


if __name__ == "__main__":
    main()
