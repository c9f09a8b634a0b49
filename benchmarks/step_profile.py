"""Where one RL step's wall time goes, per process: a real `primerl.train` run, read back from its metrics files.

    python -m benchmarks.step_profile [--steps 20] [--skip 3] [OVERRIDE ...] [--vs OVERRIDE ...]

Runs `+experiment=reverse_text` (SFT from the cache: run `make sft` first, or pass `sft.enabled=false`) for
`--steps` steps with online evals and the ledger off, and prints, over the steady-state steps (the first `--skip`
left out), each phase's median and [min-max] in seconds:
- trainer, one row per step: waiting for the batch, reading it, forward, backward, optimizer (clip, all-reduce,
  AdamW), checkpoint (model + AdamW moments + sha256), publish (full weights for vLLM);
- orchestrator, one row per batch cut: the time since the previous cut (generation), of which waiting for a newer
  policy (async_level) and the server paused for weight loads, and packing + writing the trainer's batch file;
- the step's wall time: the gaps between the trainer's consecutive rows (median and range, and their mean, which
  counts the slow steps a median hides), and the whole command's wall time (vLLM start-up and shutdown included).
With `--vs OVERRIDE ...` a second run with those overrides follows the first, and a last column gives the ratio
of the medians (second / first): one command, two configurations, measured side by side.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from primerl.metrics import ORCHESTRATOR, TRAINER, read_metrics
from primerl.utils.process import free_port

TRAINER_PHASES = [
    "time/wait_batch_s",
    "time/read_batch_s",
    "time/forward_s",
    "time/backward_s",
    "time/optimizer_s",
    "time/checkpoint_s",
    "time/publish_s",
]
ORCHESTRATOR_PHASES = [
    "time/generate_s",
    "time/wait_policy_s",
    "time/weight_load_s",
    "time/write_batch_s",
    "time/rollout_median_s",
    "inference/idle_fraction",
]
STEP_WALL = "step wall (row gap)"
MEAN_STEP = "step wall (mean over the span)"
COMMAND = "whole command"


def run(steps: int, overrides: list[str], run_dir: Path) -> dict[str, list[float]]:
    """One real train run; each phase's values over its steps, by name (process/phase)."""
    cmd = [
        sys.executable,
        "-m",
        "primerl.train",
        "+experiment=reverse_text",
        f"trainer.max_steps={steps}",
        "eval.every=0",
        "ledger.enabled=false",
        f"inference.port={free_port()}",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"run failed ({' '.join(overrides) or 'defaults'}):\n{result.stderr[-3000:]}")
    command_s = time.perf_counter() - started
    print(f"  {steps} steps in {command_s:.0f} s (whole command, vLLM start-up included)")
    trainer, orch = read_metrics(run_dir, TRAINER), read_metrics(run_dir, ORCHESTRATOR)
    phases = {
        f"trainer {k.removeprefix('time/')}": [r[k] for r in trainer if r.get(k) is not None] for k in TRAINER_PHASES
    }
    phases |= {
        f"orchestrator {k.removeprefix('time/')}": [r[k] for r in orch if r.get(k) is not None]
        for k in ORCHESTRATOR_PHASES
    }
    phases[STEP_WALL] = [b["time"] - a["time"] for a, b in zip(trainer, trainer[1:])]
    phases[COMMAND] = [command_s]
    return phases


def steady(values: list[float], skip: int) -> list[float]:
    return values[skip:] or values  # one-value rows (the whole command) stay


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} [{min(values):.3f}-{max(values):.3f}]" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (start-up, first weight loads)")
    parser.add_argument("--vs", nargs="+", default=None, metavar="OVERRIDE", help="a second run with these overrides")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    variants = {"run 1": args.overrides}
    if args.vs:
        variants["run 2"] = args.overrides + args.vs
    results = {}
    with tempfile.TemporaryDirectory(prefix="primerl-profile-") as root:
        for name, overrides in variants.items():
            print(f"{name}: {' '.join(overrides) or '(defaults)'}", flush=True)
            results[name] = run(args.steps, overrides, Path(root) / name.replace(" ", ""))
            gaps = steady(results[name][STEP_WALL], args.skip)
            results[name][MEAN_STEP] = [statistics.mean(gaps)] if gaps else []
    print(f"\nsteps {args.skip}..{args.steps - 1}: median [min-max], seconds (idle_fraction: a fraction)")
    print(f"{'phase':<34}" + "".join(f"{name:>26}" for name in results) + ("   ratio" if args.vs else ""))
    for phase in results["run 1"]:
        values = [steady(r[phase], args.skip) for r in results.values()]
        line = f"{phase:<34}" + "".join(f"{cell(v):>26}" for v in values)
        if args.vs and all(values) and statistics.median(values[0]) > 0:
            line += f"  {statistics.median(values[1]) / statistics.median(values[0]):6.2f}"
        print(line)


if __name__ == "__main__":
    main()
