"""Trainer tokens/s per parallel layout: the same RL batch trained by `primerl.trainer` under torchrun.

    python -m benchmarks.parallel [--samples 256] [--steps 3]

Layouts: 1 rank; fsdp2 on 2 ranks; fsdp2_cp on 2 ranks (each row split in two); and for the MoE model, 1 rank and
fsdp2_ep on 2 ranks. Each run trains `steps` copies of one batch of primerl-reverse-text sequences (packed rows of 512)
and reports the trainer's own `throughput/tokens_per_s` (computed tokens over forward + backward + optimizer,
excluding the checkpoint and publish), median over the steps after the first. On a 2-core CPU, 2 ranks share
the cores a single rank already uses, so the figures show each layout's communication cost, not a speed-up.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from primerl_reverse_text.texts import make_texts, prompt_messages

from primerl.metrics import read_metrics
from primerl.model.tiny import build_tokenizer
from primerl.orchestrator.batch import build_batch
from primerl.sft.data import chat_example
from primerl.transport.batches import Sample, write_rollout_batch

LAYOUTS = [
    ("tiny", "fsdp2", 1),
    ("tiny", "fsdp2", 2),
    ("tiny", "fsdp2_cp", 2),
    ("tiny_moe", "fsdp2", 1),
    ("tiny_moe", "fsdp2_ep", 2),
]


def batch_samples(n: int) -> list[Sample]:
    tok = build_tokenizer()
    out = []
    for i, text in enumerate(make_texts(99, n)):
        ex = chat_example(tok, prompt_messages(text), text[::-1])
        # logprobs of -1 keep the importance ratio inside the trust region for a freshly built model
        out.append(Sample(ex.input_ids, ex.loss_mask, [-1.0] * len(ex.input_ids), 1.0, (-1) ** i * 0.5, 0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    samples = batch_samples(args.samples)
    print(f"{'model':<9} {'layout':<9} {'ranks':>5} {'tokens/s':>9} {'step s':>7}")
    with tempfile.TemporaryDirectory(prefix="primerl-bench-") as root:
        for model, layout, nproc in LAYOUTS:
            run = Path(root) / f"{model}-{layout}-{nproc}"
            for step in range(args.steps):
                write_rollout_batch(
                    run,
                    build_batch(
                        samples, step, seq_len=512, micro_batch_size=1, pad_id=0, temperature=1.0, async_level=1
                    ),
                )
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                "-m",
                "primerl.entrypoints.trainer",
                "+experiment=reverse_text",
                "sft.enabled=false",
                f"model={model}",
                f"parallelism={layout}",
                f"trainer.max_steps={args.steps}",
                f"output_dir={run}",
                f"hydra.run.dir={run}/logs",
                f"cache_dir={root}/cache",
            ]
            result = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))},
            )
            if result.returncode != 0:
                sys.exit(f"{model} {layout} x{nproc} failed:\n{result.stderr[-3000:]}")
            rows = read_metrics(run, "trainer")[1:] or read_metrics(run, "trainer")
            tps = statistics.median(r["throughput/tokens_per_s"] for r in rows)
            step_s = statistics.median(r["time/step_s"] for r in rows)
            print(f"{model:<9} {layout:<9} {nproc:>5} {tps:>9.0f} {step_s:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
