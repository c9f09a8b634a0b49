"""How far two runs of the same command agree, with and without per-request sampling seeds
(`orchestrator.seed_requests`): for each step, the share of the batch's samples (prompt and completion tokens) that
the other run's batch of that step also holds, and whether the step's mean reward is the same.

    python -m benchmarks.rerun_agreement [--steps 10] [--out /tmp/rerun_agreement] [OVERRIDES ...]

Each setting runs the reverse_text experiment twice, one run after the other, into fresh run directories (the SFT
warm-start comes from the cache, so both start from the same weights; online evals off). Extra overrides go to
every run (e.g. `orchestrator.async_level=0`).
"""

import argparse
import collections
import subprocess
import sys
import time
from pathlib import Path

from primerl.metrics import ORCHESTRATOR, OrchestratorMetric, read_metrics
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import rollout_path

SETTINGS = {"seeded": "orchestrator.seed_requests=true", "unseeded": "orchestrator.seed_requests=false"}


def batch_samples(run: Path, step: int) -> collections.Counter:
    """The step's samples as token tuples (packed rows split where position_ids restart; padding dropped)."""
    samples = collections.Counter()
    for micro in read_rollout_batch(rollout_path(run, step)).micro_batches:
        for ids, positions in zip(micro["input_ids"].tolist(), micro["position_ids"].tolist()):
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
            for a, b in zip(starts, starts[1:]):
                if b - a > 1:  # a pad is a one-token segment
                    samples[tuple(ids[a:b])] += 1
    return samples


def run_once(out: Path, steps: int, overrides: list[str]) -> tuple[Path, float]:
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "primerl.train", "+experiment=reverse_text", f"trainer.max_steps={steps}"]
    cmd += [
        "eval.every=0",
        "inference.port=0",
        f"hydra.run.dir={out}",
        f"ledger.store_dir={out.parent / 'ledger'}",
        *overrides,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out, time.perf_counter() - started


def agreement(a: Path, b: Path, steps: int) -> list[tuple[float, bool]]:
    rewards = [
        {row["step"]: row[OrchestratorMetric.REWARD_MEAN] for row in read_metrics(run, ORCHESTRATOR)} for run in (a, b)
    ]
    rows = []
    for step in range(steps):
        sa, sb = batch_samples(a, step), batch_samples(b, step)
        shared = sum((sa & sb).values()) / max(sum(sa.values()), 1)
        rows.append((shared, rewards[0].get(step) == rewards[1].get(step)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("/tmp/rerun_agreement"))
    args, overrides = parser.parse_known_args()
    results = {}
    for name, setting in SETTINGS.items():
        runs = [run_once(args.out / f"{name}_{i}", args.steps, [setting, *overrides]) for i in (0, 1)]
        print(f"{name}: runs of {runs[0][1]:.0f} s and {runs[1][1]:.0f} s", flush=True)
        results[name] = agreement(runs[0][0], runs[1][0], args.steps)
    print("| step | " + " | ".join(f"{n}: samples shared, same reward" for n in SETTINGS) + " |")
    print("| --- " * (len(SETTINGS) + 1) + "|")
    for step in range(args.steps):
        cells = [f"{results[n][step][0]:.0%}, {'yes' if results[n][step][1] else 'no'}" for n in SETTINGS]
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
