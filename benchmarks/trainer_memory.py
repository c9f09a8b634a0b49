"""Trainer peak memory and tokens/s of one RL step with Qwen3's vocabulary: full vs chunked scoring, activation
checkpointing off and on, fp32 vs bf16.

    python -m benchmarks.trainer_memory [--seq 1024 2048] [--layers 4] [--hidden 256] [--chunk 256] [--steps 3]

The model is a random Qwen3-architecture model with Qwen3's vocabulary (151,936 tokens, tied embeddings) and a
small body (`--layers`, `--hidden`), so the output layer dominates as it does at seq 1-4k for Qwen3-0.6B. Each
setting runs in a fresh process through primerl's own Trainer (world size 1, gloo): one micro-batch of one packed
row of `seq` tokens, `--steps` (>= 2) RL steps of the real loss. Peak memory is the growth of the process's peak
resident set (VmHWM, reset through /proc/self/clear_refs after the first step, once the optimizer's state exists)
over the later steps: activations, scores, gradients; tokens/s is the median over the steps after the first. "full" scores a whole micro-batch at once (trainer.logprob_chunk_size=null: the
rows x seq x vocab logits in fp32); "chunked" scores `--chunk` tokens at a time.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_VOCAB = 151_936
SETTINGS = [  # (name, chunk, activation checkpointing, precision)
    ("full", False, False, "fp32"),
    ("chunked", True, False, "fp32"),
    ("full + checkpointing", False, True, "fp32"),
    ("chunked + checkpointing", True, True, "fp32"),
    ("full, bf16", False, False, "bf16"),
    ("chunked + checkpointing, bf16", True, True, "bf16"),
]


def build_model(directory: Path, layers: int, hidden: int, dtype: str = "float32") -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(directory)


def _peak_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(model_dir: str, seq: int, chunk: int | None, checkpointing: bool, precision: str, steps: int) -> dict:
    """In this process: build the trainer, run `steps` RL steps on one random row, return the figures."""
    import torch

    from primerl.config.trainer import LossConfig, OptimConfig, TrainerConfig
    from primerl.trainer.dist import close_distributed, init_distributed
    from primerl.trainer.loss import policy_loss
    from primerl.trainer.trainer import Trainer

    torch.manual_seed(0)
    info = init_distributed("gloo")
    compute = TrainerConfig(precision=precision, logprob_chunk_size=chunk, activation_checkpointing=checkpointing)
    trainer = Trainer.build(model_dir, info, OptimConfig(lr=1e-6), compute)
    ids = torch.randint(0, QWEN3_VOCAB, (1, seq))
    micro = {
        "input_ids": ids,
        "position_ids": torch.arange(seq).unsqueeze(0),
        "loss_mask": torch.arange(seq).unsqueeze(0) >= seq // 4,  # the last 3/4 of the row was sampled
        "inference_logprobs": torch.full((1, seq), -12.0),
        "advantages": torch.full((1, seq), 0.5),
    }
    tokens = int(micro["loss_mask"].sum())

    def loss_fn(scores, m):
        parts = policy_loss(scores, m, tokens, LossConfig())
        return parts.loss, parts.sums()

    rates, before = [], 0
    for step in range(steps):
        if step == 1:  # from the second step: the optimizer's state exists, the peak is the step's own
            Path("/proc/self/clear_refs").write_text("5")
            before = _peak_kib()
        started = time.perf_counter()
        trainer.step(step, [micro], loss_fn)
        rates.append(seq / (time.perf_counter() - started))
    peak_mib = (_peak_kib() - before) / 1024
    close_distributed()
    return {"peak_mib": round(peak_mib), "tokens_per_s": round(statistics.median(rates[1:] or rates), 1)}


def run_setting(model_dir: Path, seq: int, chunk: int | None, checkpointing: bool, precision: str, steps: int):
    args = [model_dir, seq, chunk, checkpointing, precision, steps]
    code = f"import json, benchmarks.trainer_memory as b; print(json.dumps(b.measure(*{[str(args[0]), *args[1:]]!r})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise SystemExit(f"seq {seq} {precision}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step builds the optimizer's state)")
    with tempfile.TemporaryDirectory(prefix="primerl-memory-") as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, args.layers, args.hidden)
        print(f"Qwen3 vocabulary {QWEN3_VOCAB}, {args.layers} layers of {args.hidden}; chunk {args.chunk} tokens")
        print("| seq | setting | peak MiB over the step | tokens/s |\n| --- | --- | --- | --- |")
        for seq in args.seq:
            base = None
            for name, chunked, checkpointing, precision in SETTINGS:
                chunk = args.chunk if chunked else None
                figures = run_setting(model_dir, seq, chunk, checkpointing, precision, args.steps)
                base = base or figures
                ratio = base["peak_mib"] / max(figures["peak_mib"], 1)
                speed = figures["tokens_per_s"] / base["tokens_per_s"]
                print(
                    f"| {seq} | {name} | {figures['peak_mib']} ({ratio:.1f}x less) | "
                    f"{figures['tokens_per_s']} ({speed:.2f}x) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
