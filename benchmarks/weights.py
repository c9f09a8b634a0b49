"""Policy update latency by transport, side by side on one real vLLM server per model size.

    python -m benchmarks.weights [--sizes 256 512 1024 2048] [--rounds 5] [--bucket-mb 256]

For each tiny Qwen3 width (4 layers, benchmarks.inference.arch_overrides) one vLLM server; then rounds alternate the
two transports on it, each a new version (every weight moved), as the trainer's rank 0 and the orchestrator do it:
- filesystem: trainer side = writing the safetensors directory (save_hf_checkpoint, fsync'd, with its fingerprint);
  server side = the in-flight load (pause, read, reload, resume).
- collective: trainer side = from the offer to the last bucket sent (join on the first round, then send); server
  side = the in-flight load (pause, name the group, receive bucket by bucket into the reload, resume).
Both sides run at once in the collective case, one after the other in the filesystem case; `total` is the wall time
from the trainer starting to the server serving. The trainer's FSDP gather, the same for both, is not in it.
Medians and ranges over the rounds.
"""

import argparse
import asyncio
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.inference import model_of_width
from primerl.inference.server import VllmServer
from primerl.inference.vllm_args import render_specs
from primerl.orchestrator.inference_client import InferenceClient
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.collective import WeightSender
from primerl.transport.offer import plan_buckets, publish_offer, spec_of
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import answer_offer, published_fingerprint, rendezvous_dir, write_fingerprint


def moved(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=generator).to(v.dtype) for k, v in state.items()}


async def by_filesystem(client: InferenceClient, root: Path, model_dir: str, state, version: int) -> dict:
    started = time.perf_counter()
    path = save_hf_checkpoint(state, model_dir, weights_path(root, version))
    written = time.perf_counter()
    loaded = await client.load_weights(path, version)
    assert loaded.fingerprint == published_fingerprint(path)
    shutil.rmtree(path)
    return {"trainer": written - started, "server": loaded.seconds, "total": time.perf_counter() - started}


async def by_collective(client, sender: WeightSender, root: Path, state, version: int, bucket_bytes: int) -> dict:
    started = time.perf_counter()
    path = weights_path(root, version)
    made = sender.offer(version, plan_buckets([spec_of(k, v) for k, v in state.items()], bucket_bytes))
    publish_offer(path, made)
    group, members = await client.collective_group(0)
    answer_offer(path, made.id, {group: members})
    timing = {}

    def send() -> None:
        begun = time.perf_counter()
        write_fingerprint(path, sender.transfer(made, {group: members}, iter(state.items())))
        timing["trainer"] = time.perf_counter() - begun

    thread = threading.Thread(target=send)
    thread.start()
    loaded = await client.load_weights(path, version, group)
    await asyncio.to_thread(thread.join)
    assert loaded.fingerprint == published_fingerprint(path)
    shutil.rmtree(path)
    return {**timing, "server": loaded.seconds, "total": time.perf_counter() - started}


def one_size(hidden: int, rounds: int, bucket_mb: int, root: Path) -> None:
    cfg, model_dir = model_of_width(hidden, root)
    state = load_file(Path(model_dir) / "model.safetensors")
    state = {k: v.to(getattr(torch, cfg.model.dtype)) for k, v in state.items()}
    mb = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    (spec,) = render_specs(cfg, model_dir, "cpu")
    sender = WeightSender("127.0.0.1", rendezvous_dir(root), "gloo", timeout_s=120)
    found: dict[str, list[dict]] = {"filesystem": [], "collective": []}

    async def run() -> None:
        async with InferenceClient(spec.base_url) as client:
            for index in range(rounds):
                version = 2 * index + 1
                found["filesystem"].append(await by_filesystem(client, root, model_dir, moved(state, version), version))
                found["collective"].append(
                    await by_collective(client, sender, root, moved(state, version + 1), version + 1, bucket_mb << 20)
                )

    with VllmServer(spec, root / f"vllm-{hidden}.log").start():
        asyncio.run(run())
    for transport, rows in found.items():
        cells = []
        for side in ("trainer", "server", "total"):
            values = [row[side] for row in rows]
            cells.append(f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
        print(f"| {hidden} | {mb:.1f} | {transport} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-bench-weights-"))
    print(f"seconds, median [min, max] of {args.rounds} rounds; buckets of {args.bucket_mb} MiB")
    print(
        "| hidden | MB | transport | trainer side s | server side s | total s |\n| --- | --- | --- | --- | --- | --- |"
    )
    try:
        for hidden in args.sizes:
            one_size(hidden, args.rounds, args.bucket_mb, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
