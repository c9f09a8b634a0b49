"""Async vs sync RL: the same primerl-reverse-text work with orchestrator.async_level=0, 1 and 2.

    python -m benchmarks.async_vs_sync [--steps 12] [--levels 0 1 2] [OVERRIDE ...]

Each level is a real `primerl.train +experiment=reverse_text` run (SFT warm-start from the cache; ledger off).
Throughput is measured in steady state: samples trained between the trainer's first and last step, divided by
that wall time. G (generation per step) and T (training + publish per step) are the runs' own means, so the
ideal speed-up of overlapping them is (G+T)/max(G,T) with the sync run's G and T. On a small CPU machine the
inference server and the trainer share the same cores, so overlapped work runs slower than alone: the measured
ratio shows that contention, not only the schedule.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from primerl.metrics import read_metrics
from primerl.utils.process import free_port


def run_level(level: int, steps: int, overrides: list[str], root: Path) -> dict[str, float]:
    run = root / f"async{level}"
    cmd = [
        sys.executable,
        "-m",
        "primerl.train",
        "+experiment=reverse_text",
        f"orchestrator.async_level={level}",
        f"trainer.max_steps={steps}",
        f"inference.port={free_port()}",
        f"hydra.run.dir={run}",
        "ledger.enabled=false",
        *overrides,
    ]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"async_level={level} failed:\n{result.stderr[-3000:]}")
    trainer, orch = read_metrics(run, "trainer"), read_metrics(run, "orchestrator")
    samples = [r["rollouts/ok"] for r in orch]
    span = trainer[-1]["time"] - trainer[0]["time"]
    return {
        "samples_per_s": sum(samples[1:]) / span,
        "G": statistics.mean(r["time/generate_s"] for r in orch),
        "T": statistics.mean(r["time/step_s"] + r.get("time/save_s", 0.0) for r in trainer),
        "wait_policy": statistics.mean(r["time/wait_policy_s"] for r in orch),
        "wait_batch": statistics.mean(r["time/wait_batch_s"] for r in trainer[1:]),
        "wall": time.perf_counter() - started,
        "reward": orch[-1]["reward/mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="primerl-bench-") as root:
        results = {}
        for level in args.levels:
            print(f"running async_level={level} ({args.steps} steps) ...", flush=True)
            results[level] = run_level(level, args.steps, args.overrides, Path(root))
    base = results[min(results)]
    ideal = (base["G"] + base["T"]) / max(base["G"], base["T"])
    print(
        f"\n{'async_level':>11} {'samples/s':>10} {'ratio':>6} {'G s':>6} {'T s':>6} {'wait policy':>12} "
        f"{'wait batch':>11} {'wall s':>7}"
    )
    for level, r in results.items():
        print(
            f"{level:>11} {r['samples_per_s']:>10.2f} {r['samples_per_s'] / base['samples_per_s']:>6.2f} "
            f"{r['G']:>6.2f} {r['T']:>6.2f} {r['wait_policy']:>12.2f} {r['wait_batch']:>11.2f} {r['wall']:>7.0f}"
        )
    print(f"\nideal ratio (G+T)/max(G,T) from the async_level={min(results)} run: {ideal:.2f}")


if __name__ == "__main__":
    main()
