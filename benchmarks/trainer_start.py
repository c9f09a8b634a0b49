"""Peak host memory per rank while the trainer builds its model: every rank loading the whole model before FSDP2
shards it, vs primerl's start (parameters on the meta device, each rank reading only its shards:
primerl.trainer.model_load).

    python -m benchmarks.trainer_start [--ranks 2] [--layers 8] [--hidden 1024] [--rounds 2]

The model is a random Qwen3-architecture model with Qwen3's vocabulary (151,936 tokens, tied embeddings), stored in
bf16 as hub checkpoints are; the trainer holds it in fp32. Each setting runs in fresh processes under torchrun (gloo
on the CPU); each rank reports the growth of its peak resident set (VmHWM) from just before the build to just after
it, and the build's seconds. "whole model per rank" is the start primerl had before model_load: `from_pretrained`
on every rank, then FSDP2 sharding. Rounds alternate the two settings; medians and ranges over rounds and ranks.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.trainer_memory import build_model

SETTINGS = ("whole model per rank", "meta + sharded read")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build_whole(base: str, info) -> None:
    """The start before model_load: the whole fp32 model on every rank, then sharded."""
    import torch
    from transformers import AutoModelForCausalLM

    from primerl.trainer.dist import data_mesh, shard_model

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    shard_model(model, data_mesh(info, info.world_size))


def rank_main(setting: str, base: str, out: str) -> None:
    """Under torchrun: build the model one way, write this rank's figures to OUT/rank<r>.json."""
    import torch

    from primerl.config.trainer import OptimConfig, TrainerConfig
    from primerl.trainer.dist import close_distributed, init_distributed
    from primerl.trainer.trainer import Trainer

    info = init_distributed("gloo")
    torch.distributed.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before, started = _kib("VmHWM"), time.perf_counter()
    if setting == SETTINGS[0]:
        build_whole(base, info)
    else:
        Trainer.build(base, info, OptimConfig(lr=1e-6), TrainerConfig())
    seconds = time.perf_counter() - started
    figures = {"peak_growth_mib": (_kib("VmHWM") - before) / 1024, "seconds": seconds}
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(figures))
    torch.distributed.barrier()
    close_distributed()


def run_setting(setting: str, base: Path, ranks: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd += ["-m", "benchmarks.trainer_start", "--rank-main", setting, str(base), out]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank-main", nargs=3, metavar=("SETTING", "BASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(*args.rank_main)
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "model"
        build_model(base, args.layers, args.hidden, dtype="bfloat16")
        params = json.loads((base / "config.json").read_text())
        fp32_mib = sum(p.stat().st_size for p in base.glob("*.safetensors")) * 2 / 2**20  # bf16 on disk
        print(
            f"model: {args.layers} layers, hidden {args.hidden}, vocab {params['vocab_size']}: ~{fp32_mib:.0f} MiB in fp32"
        )
        figures: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        for round_ in range(args.rounds):
            for setting in SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]:
                figures[setting] += run_setting(setting, base, args.ranks)
    summary = {"ranks": args.ranks, "model_fp32_mib": round(fp32_mib), "settings": {}}
    for setting, rows in figures.items():
        peaks, seconds = [r["peak_growth_mib"] for r in rows], [r["seconds"] for r in rows]
        summary["settings"][setting] = {
            "peak_growth_mib_median": round(statistics.median(peaks)),
            "peak_growth_mib_range": [round(min(peaks)), round(max(peaks))],
            "seconds_median": round(statistics.median(seconds), 2),
            "seconds_range": [round(min(seconds), 2), round(max(seconds), 2)],
        }
        print(
            f"{setting:>22}: peak growth per rank {statistics.median(peaks):6.0f} MiB "
            f"({min(peaks):.0f}-{max(peaks):.0f}), {statistics.median(peaks) / fp32_mib:.2f}x the fp32 model; "
            f"build {statistics.median(seconds):.1f} s ({min(seconds):.1f}-{max(seconds):.1f})"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
