"""How far two runs of the same command agree, with and without per-request sampling seeds
(`orchestrator.seed_requests`): for each step, the share of the batch's samples (prompt and completion tokens) that
the other run's batch of that step also holds, and whether the step's mean reward is the same.

    python -m benchmarks.rerun_agreement [--steps 10] [--out /tmp/rerun_agreement] [OVERRIDES ...]

Each setting runs the reverse_text experiment twice, one run after the other, into fresh run directories (the SFT
warm-start comes from the cache, so both start from the same weights; online evals off). Extra overrides go to
every run: `orchestrator.drain_per_step=true orchestrator.async_level=0` makes each batch exactly the groups drawn
for it, sampled by the policy of its step (with continuous dispatch the groups that finish first make the batch).
"""

import argparse
import collections
import subprocess
import sys
import time
from pathlib import Path

from primerl.metrics import ORCHESTRATOR, TRAINER, OrchestratorMetric, read_metrics
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import rollout_path, weights_path

SETTINGS = {"seeded": "orchestrator.seed_requests=true", "unseeded": "orchestrator.seed_requests=false"}


def batch_samples(run: Path, step: int) -> collections.Counter:
    """The step's samples as token tuples (packed rows split where position_ids restart; padding, which has no
    loss tokens, dropped)."""
    samples = collections.Counter()
    for micro in read_rollout_batch(rollout_path(run, step)).micro_batches:
        rows = zip(micro["input_ids"].tolist(), micro["position_ids"].tolist(), micro["loss_mask"].tolist())
        for ids, positions, mask in rows:
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
            for a, b in zip(starts, starts[1:]):
                if any(mask[a:b]):
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


def shared(a: collections.Counter, b: collections.Counter) -> float:
    return sum((a & b).values()) / max(sum(a.values()), 1)


def agreement(a: Path, b: Path, steps: int) -> tuple[list[tuple[float, bool]], float]:
    """Per step: (share of the samples both batches hold, the same mean reward); and the share over the whole run
    (a sample may land in another step's batch when groups finish in another order)."""
    rewards = [
        {row["step"]: row[OrchestratorMetric.REWARD_MEAN] for row in read_metrics(run, ORCHESTRATOR)} for run in (a, b)
    ]
    per_step = [[batch_samples(run, step) for step in range(steps)] for run in (a, b)]
    rows = [
        (shared(per_step[0][step], per_step[1][step]), rewards[0].get(step) == rewards[1].get(step))
        for step in range(steps)
    ]
    return rows, shared(sum(per_step[0], collections.Counter()), sum(per_step[1], collections.Counter()))


def trainer_agreement(a: Path, b: Path, steps: int) -> str:
    """How far the two trainers agree: equal losses, and the largest difference of the final weights."""
    from safetensors.torch import load_file

    losses = [{row["step"]: row["loss"] for row in read_metrics(run, TRAINER)} for run in (a, b)]
    equal = sum(losses[0].get(step) == losses[1].get(step) for step in range(steps))
    final = [load_file(weights_path(run, steps) / "model.safetensors") for run in (a, b)]
    diff = max(float((final[0][k] - final[1][k]).abs().max()) for k in final[0])
    return f"losses equal at {equal} of {steps} steps, final weights differ by at most {diff:.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("/tmp/rerun_agreement"))
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args, overrides = parser.parse_known_args()
    results = {}
    for name in args.settings:
        setting = SETTINGS[name]
        runs = [run_once(args.out / f"{name}_{i}", args.steps, [setting, *overrides]) for i in (0, 1)]
        print(f"{name}: runs of {runs[0][1]:.0f} s and {runs[1][1]:.0f} s", flush=True)
        results[name] = agreement(runs[0][0], runs[1][0], args.steps)
        print(f"{name}: trainer {trainer_agreement(runs[0][0], runs[1][0], args.steps)}", flush=True)
    print("| step | " + " | ".join(f"{n}: samples shared, same reward" for n in results) + " |")
    print("| --- " * (len(results) + 1) + "|")
    for step in range(args.steps):
        cells = [f"{results[n][0][step][0]:.0%}, {'yes' if results[n][0][step][1] else 'no'}" for n in results]
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("| whole run | " + " | ".join(f"{results[n][1]:.0%}" for n in results) + " |")


if __name__ == "__main__":
    main()
