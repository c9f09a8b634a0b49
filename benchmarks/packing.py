"""Trainer tokens/s with sequence packing vs padding, on the tiny model and primerl-reverse-text RL sequences.

    python -m benchmarks.packing [--samples 256] [--seq-len 512] [--repeats 3]

The same samples (chat prompt + reversed answer, as the orchestrator hands them over) go through forward +
backward of the RL loss (primerl.trainer.loss) three ways:
  packed     primerl's layout: samples packed whole into rows of seq-len (block-causal via position_ids);
  pad-batch  one sample per row, padded to the longest sample of each micro-batch;
  pad-fixed  one sample per row, padded to seq-len (what a fixed-shape trainer does).
Reported: real (non-pad) tokens per second, rows, and the share of computed tokens that are padding.
"""

import argparse
import time

import torch
from primerl_reverse_text.texts import make_texts, prompt_messages
from transformers import AutoModelForCausalLM

from primerl.config.model import TinyArchConfig
from primerl.config.trainer import LossConfig
from primerl.model.tiny import build_tiny_model, build_tokenizer
from primerl.sft.data import chat_example
from primerl.trainer.logprobs import full_scores, next_tokens
from primerl.trainer.loss import policy_loss
from primerl.transport.packing import pack_sequences

PAD = {"input_ids": 0, "loss_mask": False, "inference_logprobs": 0.0, "advantages": 0.0}


def sequences(n: int) -> list[dict[str, list]]:
    tok = build_tokenizer()
    out = []
    for i, text in enumerate(make_texts(1234, n)):
        ex = chat_example(tok, prompt_messages(text), text[::-1])
        out.append(
            {
                "input_ids": ex.input_ids,
                "loss_mask": ex.loss_mask,
                "inference_logprobs": [-1.0] * len(ex.input_ids),
                "advantages": [1.0 if i % 2 else -1.0] * len(ex.input_ids),
            }
        )
    return out


def layouts(seqs: list[dict], seq_len: int, rows_per_micro: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    def micro_batches(rows: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [
            {k: v[i : i + rows_per_micro] for k, v in rows.items()}
            for i in range(0, len(rows["input_ids"]), rows_per_micro)
        ]

    def padded(width_of) -> list[dict[str, torch.Tensor]]:
        out = []
        for i in range(0, len(seqs), rows_per_micro):
            chunk = seqs[i : i + rows_per_micro]
            width = width_of(chunk)
            rows = [pack_sequences([s], width, PAD) for s in chunk]
            out.append({k: torch.cat([r[k] for r in rows]) for k in rows[0]})
        return out

    return {
        "packed": micro_batches(pack_sequences(seqs, seq_len, PAD)),
        "pad-batch": padded(lambda chunk: max(len(s["input_ids"]) for s in chunk)),
        "pad-fixed": padded(lambda chunk: seq_len),
    }


def run(model, micro: list[dict[str, torch.Tensor]], total_tokens: int) -> float:
    started = time.perf_counter()
    for mb in micro:
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        scores = full_scores(logits, next_tokens(mb["input_ids"]))
        policy_loss(scores, mb, total_tokens, LossConfig()).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1, help="rows per micro-batch (trainer.micro_batch_size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default="/tmp/primerl-bench-cache")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(args.cache, TinyArchConfig(), 0)).train()
    seqs = sequences(args.samples)
    real = sum(len(s["input_ids"]) for s in seqs)
    loss_tokens = sum(sum(s["loss_mask"][1:]) for s in seqs)
    print(
        f"{args.samples} samples, {real} real tokens (mean length {real / len(seqs):.1f}), seq_len {args.seq_len}, "
        f"{args.rows} row(s) per micro-batch, {torch.get_num_threads()} threads; best of {args.repeats}"
    )
    print(
        f"{'layout':<10} {'rows':>6} {'computed':>9} {'padding':>8} {'seconds':>8} {'real tok/s':>11} {'time vs packed':>15}"
    )
    results = {}
    for name, micro in layouts(seqs, args.seq_len, args.rows).items():
        computed = sum(mb["input_ids"].numel() for mb in micro)
        seconds = min(run(model, micro, loss_tokens) for _ in range(args.repeats))
        results[name] = seconds
        rows = sum(len(mb["input_ids"]) for mb in micro)
        print(
            f"{name:<10} {rows:>6} {computed:>9} {1 - real / computed:>8.1%} {seconds:>8.2f} {real / seconds:>11.0f} "
            f"{results['packed'] and seconds / results['packed']:>14.2f}x"
        )


if __name__ == "__main__":
    main()
