"""Trainer egress and time to serving against the number of receiving replicas: whole and delta updates, each
replica in its own group with the trainer or passing the buckets on (`weights.relay`).

    python -m benchmarks.weights_fanout [--sizes 256 1024] [--receivers 1 2 4 8 16] [--changed 0.1] [--rounds 3]
                                        [--bucket-mb 16]

The trainer's side is the run's `WeightSender` over gloo on loopback; each receiver is a process running the
workers' receive-and-verify code (`WeightReceiver.tensors`, a `Fingerprint` of every byte received, compared with
the trainer's, `settle`), without vLLM: a stand-in for a replica of one worker, so that 16 fit on 2 cores. Per
width (the tiny Qwen3 of benchmarks.inference, bf16), receiver count and mode (a group for each receiver, or
`weights.relay`: the receivers pass each bucket on in a chain), `--rounds` pairs of versions, each changing
`--changed` of the values (the next representable bf16 value, so each of them changes its bits): one sent whole (the
receivers hold no base), the next as a delta against it. Egress: the bytes trainer rank 0 put into the groups;
time: from the first bucket to the last receiver's proven load. Medians and ranges over the rounds. The receivers
share the machine's cores with the sender, so at many receivers the times measure CPU as much as the protocol.
"""

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.inference import model_of_width
from primerl.transport.collective import WeightSender
from primerl.transport.delta import decode, encode
from primerl.transport.fingerprint import Fingerprint
from primerl.transport.offer import Offer, plan_buckets, spec_of
from primerl.transport.receiver import WeightReceiver


def receive(conn, device: str = "cpu") -> None:
    """One stand-in replica: for each offer it is sent, receive, fingerprint, report; settle on the verdict. On a GPU
    (`device` cuda:N) it receives there, as a vLLM worker does over NCCL."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = WeightReceiver()
    conn.send(receiver.identity)
    while (message := conn.recv()) is not None:
        offer, group = Offer.from_json(message[0]), message[1]
        fingerprint = Fingerprint()
        for name, tensor in receiver.tensors(offer, group, 1, 2, torch.device(device)):
            fingerprint.add(name, tensor)
        conn.send((fingerprint.hexdigest(), time.perf_counter()))
        receiver.settle(conn.recv())


def changed(state: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        bits = tensor.view(torch.int16).clone()
        bits[torch.rand(bits.shape, generator=generator) < share] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def one_version(sender, version, buckets, state, groups, conns, keep: bool) -> tuple[int, float, int]:
    """(egress bytes, seconds to the last proven load, groups sent deltas). `keep`: the receivers keep this version
    as their base (else the next version goes whole)."""
    offer = sender.offer(version, buckets)
    for conn, group in zip(conns, groups, strict=True):
        conn.send((offer.to_json(), group))
    started = time.perf_counter()
    digest = sender.transfer(offer, dict.fromkeys(groups, 2), iter(state.items()))
    reports = [conn.recv() for conn in conns]
    assert all(served == digest for served, _ in reports), "a receiver did not get the version bit for bit"
    for conn in conns:
        conn.send(digest if keep else None)
    return sum(sender.egress.values()), max(done for _, done in reports) - started, len(sender.delta_takers)


def one_size(hidden: int, receivers: list[int], share: float, rounds: int, bucket_mb: int, root: Path) -> None:
    _, model_dir = model_of_width(hidden, root)
    state = {k: v.bfloat16() for k, v in load_file(Path(model_dir) / "model.safetensors").items()}
    mb = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    buckets = plan_buckets([spec_of(k, v) for k, v in state.items()], bucket_mb << 20)
    context = mp.get_context("spawn")
    for count in receivers:
        pipes = [context.Pipe() for _ in range(count)]
        processes = [context.Process(target=receive, args=(child,), daemon=True) for _, child in pipes]
        for process in processes:
            process.start()
        conns = [parent for parent, _ in pipes]
        groups = [f"r{i}-{conn.recv()}" for i, conn in enumerate(conns)]
        for relay in (False, True):
            sender = WeightSender(
                "127.0.0.1", root / f"rendezvous-{hidden}-{count}-{relay}", "gloo", 300, delta=True, relay=relay
            )
            wholes, deltas = [], []  # alternating: a whole version kept as the base, then a delta not kept
            for index in range(rounds):
                state = changed(state, share, seed=2 * index)
                wholes.append(one_version(sender, 2 * index + 1, buckets, state, groups, conns, keep=True))
                state = changed(state, share, seed=2 * index + 1)
                deltas.append(one_version(sender, 2 * index + 2, buckets, state, groups, conns, keep=False))
            assert all(row[2] == 0 for row in wholes) and all(row[2] == count for row in deltas)
            mode = "relay" if relay else "a group each"
            print(f"| {hidden} | {mb:.1f} | {count} | {mode} | {_cells(wholes)} | {_cells(deltas)} |", flush=True)
        for conn in conns:
            conn.send(None)
        for process in processes:
            process.join(timeout=30)


def codec_rates(hidden: int, share: float, root: Path) -> str:
    """Encode and decode rates of primerl.transport.delta on this CPU, MB of bf16 weights per second (median of 3)."""
    _, model_dir = model_of_width(hidden, root)
    base = torch.cat([v.bfloat16().reshape(-1) for v in load_file(Path(model_dir) / "model.safetensors").values()])
    new = changed({"all": base}, share, seed=0)["all"]
    encoded, decoded = [], []
    for _ in range(3):
        started = time.perf_counter()
        count, payload = encode(new, base)
        encoded.append(time.perf_counter() - started)
        started = time.perf_counter()
        decode(base, count, payload)
        decoded.append(time.perf_counter() - started)
    mb = base.numel() * 2 / 1e6
    return (
        f"delta codec at hidden {hidden} ({mb:.0f} MB, {share:.0%} changed), this CPU: encode "
        f"{mb / statistics.median(encoded):.0f} MB/s, decode {mb / statistics.median(decoded):.0f} MB/s"
    )


def _cells(rows: list[tuple[int, float, int]]) -> str:
    egress, seconds = [row[0] / 2**20 for row in rows], [row[1] for row in rows]
    return (
        f"{statistics.median(egress):.1f} [{min(egress):.1f}, {max(egress):.1f}] | "
        f"{statistics.median(seconds):.3f} [{min(seconds):.3f}, {max(seconds):.3f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 1024])
    parser.add_argument("--receivers", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--changed", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=16, help="weights.bucket_mb (a relay passes on by bucket)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-bench-fanout-"))
    print(
        f"deltas: {args.changed:.0%} of the values changed per version; buckets of {args.bucket_mb} MiB; "
        f"median [min, max] of {args.rounds} rounds"
    )
    print(
        "| hidden | MiB | receivers | trainer sends to | whole: egress MiB | whole: s to serving | delta: egress MiB "
        "| delta: s to serving |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    try:
        for hidden in args.sizes:
            one_size(hidden, args.receivers, args.changed, args.rounds, args.bucket_mb, root)
        print(codec_rates(max(args.sizes), args.changed, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
