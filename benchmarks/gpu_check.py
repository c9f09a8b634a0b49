"""The trainer on a GPU, checked in minutes: a random-weight model of Qwen3-0.6B's shape trained a few steps from
generated batches through primerl's own Trainer, at each sequence length, with bf16 mixed precision and chunked
scoring, activation checkpointing off and on.

    python -m benchmarks.gpu_check [--seq 4096 16384] [--steps 3] [--json OUT]   (scripts/gpu_check.sh runs it)

Per item it prints pass/fail, tokens/s, MFU and peak GPU memory, then a JSON summary. An item passes when every
step's loss and gradient norm are finite and the step's log-probs agree with a full-vocabulary recomputation on a
slice of the row (the chunked path is the real one). MFU counts 6 x parameters x tokens plus attention's
12 x layers x hidden x seq per token (x4/3 with checkpointing, which recomputes the forward) against the device's
dense bf16 peak (`--peak-tflops`, else a table of known devices). `--cpu` with a small `--layers/--hidden` runs the
same code on a CPU (how it is tested here; no MFU there). Two last items check the weights' way to many replicas:
`weights.delta`'s codec on the device (bit-exact against the CPU path, and its rates), and `weights.relay` with
deltas to `--receivers` stand-in replicas over NCCL, one GPU each (skipped on a machine with fewer GPUs; over gloo
with `--cpu`).
"""

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_check_weights import delta_codec_item, relay_item

QWEN3_0_6B = {
    "vocab_size": 151_936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}


def build_model(directory: Path, layers: int | None, hidden: int | None) -> int:
    """A random Qwen3 model of 0.6B's shape (or smaller: `layers`, `hidden`); returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = dict(QWEN3_0_6B)
    if layers:
        shape["num_hidden_layers"] = layers
    if hidden:
        shape |= {"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_attention_heads": max(1, hidden // 64)}
        shape |= {"num_key_value_heads": max(1, hidden // 128), "head_dim": 64}
    config = Qwen3Config(max_position_embeddings=32_768, **shape)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def generated_row(seq: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One packed row of random tokens, its last 3/4 sampled, with advantages of both signs."""
    vocab = QWEN3_0_6B["vocab_size"]
    ids = torch.randint(0, vocab, (1, seq))
    positions = torch.arange(seq).unsqueeze(0)
    return ids, {
        "input_ids": ids,
        "position_ids": positions,
        "loss_mask": positions >= seq // 4,
        "inference_logprobs": torch.full((1, seq), -math.log(vocab)),
        "advantages": torch.randn(1, seq).sign(),
    }


def scores_gap(trainer, row: torch.Tensor) -> float:
    """Largest |chunked - full-vocabulary| log-prob over `row`'s positions, from the trainer's current weights."""
    from primerl.trainer.logprobs import next_tokens

    with torch.no_grad():
        model, head = trainer.model, trainer.model.lm_head
        head.targets, chunk = next_tokens(row), head.chunk
        chunked = model(input_ids=row, use_cache=False).logits[0, :-1, 0].float()
        head.chunk = None
        full = model(input_ids=row, use_cache=False).logits[0, :-1, 0].float()
        head.targets, head.chunk = None, chunk
    return (chunked - full).abs().max().item()


def run_item(model_dir: Path, params: int, seq: int, checkpointing: bool, args, info) -> dict:
    from primerl.config.trainer import LossConfig, OptimConfig, TrainerConfig
    from primerl.trainer.loss import policy_loss
    from primerl.trainer.trainer import Trainer

    torch.manual_seed(0)
    device = info.device
    compute = TrainerConfig(
        precision=args.precision, logprob_chunk_size=args.chunk, activation_checkpointing=checkpointing
    )
    trainer = Trainer.build(model_dir, info, OptimConfig(lr=1e-6), compute)
    ids, micro = generated_row(seq)
    tokens = int(micro["loss_mask"].sum())

    def loss_fn(scores, m):
        parts = policy_loss(scores, m, tokens, LossConfig())
        return parts.loss, parts.sums()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, norms, seconds = [], [], []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = trainer.step(step, [micro], loss_fn)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        losses.append(result.sums["loss"])
        norms.append(result.grad_norm)
    gap = scores_gap(trainer, ids[:, :257].to(device))
    rate = seq / statistics.median(seconds[1:] or seconds)
    config = trainer.model.config
    layers, width = config.num_hidden_layers, config.hidden_size
    flops_per_token = (6 * params + 12 * layers * width * seq) * (4 / 3 if checkpointing else 1)
    peak = peak_tflops(device, args.peak_tflops)
    finite = all(math.isfinite(x) for x in losses + norms)
    tolerance = 2e-2 if args.precision == "bf16" else 1e-4
    return {
        "seq": seq,
        "activation_checkpointing": checkpointing,
        "passed": finite and gap <= tolerance,
        "losses": losses,
        "grad_norms": norms,
        "scores_vs_full_max_gap": gap,
        "tokens_per_s": round(rate, 1),
        "mfu": round(rate * flops_per_token / (peak * 1e12), 4) if peak else None,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--cpu", action="store_true", help="run the CPU path (with a small --layers/--hidden)")
    parser.add_argument("--layers", type=int, help="fewer layers than Qwen3-0.6B's 28 (CPU tests)")
    parser.add_argument("--hidden", type=int, help="a narrower model than Qwen3-0.6B's 1024 (CPU tests)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--receivers", type=int, default=2, help="stand-in replicas of the relay item (a GPU each)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        raise SystemExit("no CUDA device here (torch.cuda.is_available() is False); --cpu runs the CPU path")
    from primerl.trainer.dist import close_distributed, init_distributed

    info = init_distributed("auto")
    device = info.device
    items = []
    with tempfile.TemporaryDirectory(prefix="primerl-gpu-check-") as tmp:
        params = build_model(Path(tmp), args.layers, args.hidden)
        print(
            f"model: {params / 1e6:.0f}M parameters (Qwen3-0.6B shape unless narrowed), {args.precision}, chunk {args.chunk}"
        )
        for seq in args.seq:
            for checkpointing in (False, True):
                try:
                    item = run_item(Path(tmp), params, seq, checkpointing, args, info)
                except torch.OutOfMemoryError as err:
                    item = {
                        "seq": seq,
                        "activation_checkpointing": checkpointing,
                        "passed": False,
                        "error": str(err)[:200],
                    }
                items.append(item)
                figures = {k: item.get(k) for k in ("tokens_per_s", "mfu", "peak_gpu_gib", "scores_vs_full_max_gap")}
                print(
                    f"{'PASS' if item['passed'] else 'FAIL'} seq {seq} checkpointing {'on ' if checkpointing else 'off'} {figures}",
                    flush=True,
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    codec = delta_codec_item(min(params, 600_000_000), device)
    items.append(codec)
    print(f"{'PASS' if codec['passed'] else 'FAIL'} delta codec {codec}", flush=True)
    relayed = relay_item(args.receivers, device.type == "cuda")
    if relayed is None:
        print(
            f"SKIP relay to {args.receivers} receivers: needs {args.receivers + 1} GPUs, this machine has "
            f"{torch.cuda.device_count()}",
            flush=True,
        )
    else:
        items.append(relayed)
        print(f"{'PASS' if relayed['passed'] else 'FAIL'} relay {relayed}", flush=True)
    close_distributed()
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "parameters": params,
        "precision": args.precision,
        "chunk": args.chunk,
        "items": items,
        "passed": all(i["passed"] for i in items),
    }
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    raise SystemExit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
