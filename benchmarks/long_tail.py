"""Lock-step vs continuous rollouts on an environment with heavy-tailed episode lengths, one after the other.

    python -m benchmarks.long_tail [--steps 12] [--max-turns 16] [--max-off 4] [--variants full generation] [--sft]

`env=long_tail` (multi-turn primerl-reverse-text: half the episodes one turn long, a fifth --max-turns long), the same batch
(64), group (8), max_off_policy_steps and model in both modes:
- lock-step: `orchestrator.drain_per_step=true`, max_inflight = one batch: start a batch of groups, wait for the last
  episode, cut, repeat (the orchestrator before continuous dispatch);
- continuous: up to 2 batches of rollouts in flight, a batch cut as soon as it is full, policies loaded in flight.
Two variants, each lock-step then continuous:
- full: `primerl.train` (inference, orchestrator, trainer at async_level 1); samples/s = samples trained per second.
  On this 2-core machine vLLM alone keeps ~1.6 cores busy while it generates, and the trainer takes its share from
  vLLM: this variant shows what scheduling gains when nothing is left idle to hide;
- generation: inference and orchestrator only (no trainer, async_level = steps): what the dispatch does to
  generation, as where training has devices of its own; samples/s = batches cut per second.
Printed per mode: samples/s, and in steady state (after the first batch, before the wind-down where admission is
capped by max_steps) the fraction of time the inference server had no running request; the off-policy lag of the
batches' samples, cancelled rollouts, dropped samples; and the episode-time shape measured in the lock-step run (per
batch: median, p90, max rollout time). By default the player is the random tiny model, allowed to write lowercase
letters only (`orchestrator.sampling_args.allowed_token_ids`), so every answer runs to --max-tokens and an episode's
time grows with its turns; vLLM's logprobs are then renormalised over the letters, so the trainer masks every token:
a throughput benchmark, not a learning one. `--sft` plays the primerl-reverse-text SFT checkpoint instead, whose ~7-token
answers cost less than the orchestrator's and trainer's own work per turn on 2 cores.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from primerl.app import check
from primerl.launch.start import prepare_start_model
from primerl.metrics import ORCHESTRATOR, TRAINER, read_metrics
from primerl.metrics import OrchestratorMetric as M
from primerl.utils.process import free_port, stop_process_groups

ASYNC_LEVEL = 1
LETTERS_ONLY = f"+orchestrator.sampling_args.allowed_token_ids=[{','.join(str(b) for b in range(97, 123))}]"
CONTEXT_KEYS = ("inference.max_model_len", "trainer.seq_len", "model.arch.max_position_embeddings")
MODES = {
    "lock-step": ["orchestrator.drain_per_step=true", "orchestrator.max_inflight={batch}"],
    "continuous": ["orchestrator.max_inflight={twice}"],
}


def overrides(mode: str, args, model: str | None, async_level: int, max_off: int) -> list[str]:
    extra = [o.format(batch=args.batch, twice=2 * args.batch) for o in MODES[mode]]
    # the SFT checkpoint plays as trained; the random model may write only lowercase letters (no EOS: every answer runs
    # to max_tokens, and its text re-renders to the same tokens, so a multi-turn episode stays one sample)
    start = ["model.source=path", f"model.path={model}"] if model else [LETTERS_ONLY]
    return [
        "+experiment=reverse_text",
        "env=long_tail",
        "sft.enabled=false",
        *start,
        f"trainer.max_steps={args.steps}",
        f"orchestrator.batch_size={args.batch}",
        "orchestrator.group_size=8",
        f"orchestrator.async_level={async_level}",
        f"orchestrator.max_off_policy_steps={max_off}",
        f"orchestrator.max_tokens={args.max_tokens}",
        f"env.args.max_turns={args.max_turns}",
        *[f"{key}={args.context}" for key in CONTEXT_KEYS],
        f"inference.port={free_port()}",
        "ledger.enabled=false",
        *extra,
        *args.overrides,
    ]


def full_run(mode: str, args, model: str | None, run_dir: Path) -> tuple[list[dict], float]:
    """`primerl.train`: inference, orchestrator and trainer; samples/s = what the trainer trained per second."""
    cmd = [
        sys.executable,
        "-m",
        "primerl.train",
        *overrides(mode, args, model, ASYNC_LEVEL, args.max_off),
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{mode} failed:\n{result.stderr[-3000:]}")
    trainer = read_metrics(run_dir, TRAINER)
    return read_metrics(run_dir, ORCHESTRATOR)[: -(ASYNC_LEVEL + 1)], args.batch * (len(trainer) - 1) / (
        trainer[-1]["time"] - trainer[0]["time"]
    )


def generation_run(mode: str, args, model: str | None, run_dir: Path) -> tuple[list[dict], float]:
    """Inference and orchestrator only, no trainer and no waiting for policies (async_level = steps): what the dispatch
    does to generation, as where training has devices of its own. samples/s = batches cut per second."""
    args_ = [*overrides(mode, args, model, args.steps, args.steps), f"output_dir={run_dir}"]
    generate_only(args_, run_dir, f"{mode} (generation only)")
    orch = read_metrics(run_dir, ORCHESTRATOR)  # the last batch is the wind-down: admission capped by max_steps
    return orch[:-1], args.batch * (len(orch) - 1) / (orch[-1]["time"] - orch[0]["time"])


def generate_only(overrides: list[str], run_dir: Path, label: str) -> str:
    """Start the inference process of `overrides` (its own session), wait for its /health, run the orchestrator to
    the end, and stop the server; returns the server's Prometheus /metrics text as the run ended. Exits with `label`
    and the orchestrator's last stderr when either fails."""
    port = int(next(a for a in overrides if a.startswith("inference.port=")).split("=")[1])
    server = subprocess.Popen(
        [sys.executable, "-m", "primerl.entrypoints.inference", *overrides, f"hydra.run.dir={run_dir}/logs/inf"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not _healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{label}: the inference server did not start (logs in {run_dir}/logs)")
            time.sleep(1)
        cmd = [
            sys.executable,
            "-m",
            "primerl.entrypoints.orchestrator",
            *overrides,
            f"hydra.run.dir={run_dir}/logs/orch",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{label} failed:\n{result.stderr[-3000:]}")
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        stop_process_groups([server], 30)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def summary(rows: list[dict], samples_per_s: float) -> dict[str, float]:
    steady = rows[1:]  # after the first batch (warm-up); callers drop the wind-down
    return {
        "samples_per_s": samples_per_s,
        "idle": statistics.mean(r[M.INFERENCE_IDLE] for r in steady if r.get(M.INFERENCE_IDLE) is not None),
        "off_mean": statistics.mean(r[M.OFF_POLICY_MEAN] for r in rows),
        "off_max": max(r[M.OFF_POLICY_MAX] for r in rows),
        "cancelled": sum(r[M.ROLLOUTS_CANCELLED] for r in rows),
        "dropped": sum(r[M.OFF_POLICY_DROPPED] for r in rows),
        "rollout_median": statistics.median(r[M.ROLLOUT_MEDIAN_S] for r in steady),
        "rollout_p90": statistics.median(r[M.ROLLOUT_P90_S] for r in steady),
        "rollout_max": statistics.median(r[M.ROLLOUT_MAX_S] for r in steady),
        "max_over_median": statistics.median(r[M.ROLLOUT_MAX_S] / r[M.ROLLOUT_MEDIAN_S] for r in steady),
        "reward": statistics.mean(r[M.REWARD_MEAN] for r in rows),
    }


def table(title: str, results: dict[str, dict[str, float]], off_policy: bool) -> None:
    lock = results["lock-step"]
    print(
        f"\n{title}\nepisode shape (lock-step, median over batches): rollout median {lock['rollout_median']:.2f}s, "
        f"p90 {lock['rollout_p90']:.2f}s, max {lock['rollout_max']:.2f}s; max/median {lock['max_over_median']:.1f}x"
    )
    print(
        f"{'mode':>10} {'samples/s':>10} {'ratio':>6} {'idle':>6} {'off-policy mean/max':>20} {'cancelled':>10} "
        f"{'dropped':>8} {'reward':>7} {'wall s':>7}"
    )
    for mode, r in results.items():
        lag = f"{r['off_mean']:>13.2f} / {r['off_max']:<4.0f}" if off_policy else f"{'(no updates)':>20}"
        print(
            f"{mode:>10} {r['samples_per_s']:>10.2f} {r['samples_per_s'] / lock['samples_per_s']:>6.2f} "
            f"{r['idle']:>6.1%} {lag} {r['cancelled']:>10.0f} {r['dropped']:>8.0f} {r['reward']:>7.3f} "
            f"{r['wall']:>7.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-off", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24, help="per turn")
    parser.add_argument("--max-turns", type=int, default=16, help="the tail episodes' length")
    parser.add_argument("--context", type=int, default=1024, help="tokens: max_model_len and trainer.seq_len")
    parser.add_argument(
        "--sft",
        action="store_true",
        help="play with the primerl-reverse-text SFT checkpoint (answers of ~7 "
        "tokens) instead of the random tiny model (answers run to --max-tokens)",
    )
    parser.add_argument("--variants", nargs="+", default=["full", "generation"], choices=["full", "generation"])
    parser.add_argument("--keep", type=Path, help="keep the two run directories under this directory")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args()
    model = prepare_start_model(check(["+experiment=reverse_text"])) if args.sft else None
    if model and not Path(model).exists():
        raise SystemExit(f"no SFT checkpoint at {model}: run `make sft` (or `make train`) first")
    variants = {
        "full": (full_run, "training and inference on the same 2 cores (primerl.train)"),
        "generation": (generation_run, "generation only (no trainer; async_level never binds)"),
    }
    with tempfile.TemporaryDirectory(prefix="primerl-longtail-") as tmp:
        root = args.keep or Path(tmp)
        for variant in args.variants:
            run, title = variants[variant]
            results = {}
            for mode in MODES:
                run_dir = root / f"{variant}-{mode}"
                print(f"running {mode}, {variant} ({args.steps} steps) in {run_dir} ...", flush=True)
                started = time.perf_counter()
                results[mode] = summary(*run(mode, args, model, run_dir)) | {"wall": time.perf_counter() - started}
            table(title, results, off_policy=variant == "full")


if __name__ == "__main__":
    main()
