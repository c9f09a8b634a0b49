"""The GPU check's two items on the weights' way to many replicas (benchmarks/gpu_check.py runs them after the
trainer's): `weights.delta`'s codec on the device, and `weights.relay` with deltas to stand-in replicas."""

import statistics
import tempfile
import time

import torch


def delta_codec_item(values: int, device: torch.device, changed: float = 0.1) -> dict:
    """`weights.delta`'s codec (primerl.transport.delta) on the device, as a GPU trainer and worker run it (torch's
    ops): a bf16 bucket of `values` with `changed` of them moved, encoded and decoded; passes when the bytes equal
    the CPU path's (numpy) and the rebuilt bucket is the new one bit for bit. Rates in GB of bf16 weights per second."""
    from primerl.transport.delta import decode, encode

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(values, generator=generator).bfloat16()
    bits = base.view(torch.int16).clone()
    bits[torch.rand(values, generator=generator) < changed] += 1
    new = bits.view(torch.bfloat16)
    on_device, base_on_device = new.to(device), base.to(device)
    timings: dict[str, list[float]] = {"encode": [], "decode": []}
    for _ in range(3):
        _sync(device)
        started = time.perf_counter()
        count, payload = encode(on_device, base_on_device, by_numpy=False)
        _sync(device)
        timings["encode"].append(time.perf_counter() - started)
        rebuilt = decode(base_on_device, count, payload, by_numpy=False)
        _sync(device)
        timings["decode"].append(time.perf_counter() - started - timings["encode"][-1])
    exact = torch.equal(payload.cpu(), encode(new, base, by_numpy=True)[1]) and torch.equal(
        rebuilt.cpu().view(torch.int16), bits
    )
    gb = values * 2 / 1e9
    return {
        "delta_codec": True,
        "passed": exact,
        "values": values,
        "delta_vs_whole": payload.numel() / (2 * values),
        "encode_gb_s": gb / statistics.median(timings["encode"]),
        "decode_gb_s": gb / statistics.median(timings["decode"]),
    }


def relay_item(receivers: int, on_gpu: bool) -> dict | None:
    """`weights.relay` with `weights.delta` through the run's sender to `receivers` stand-in replicas, one process
    each (benchmarks.weights_fanout): over NCCL with one GPU each (the sender on GPU 0), or over gloo on CPU. A whole
    version, then a delta; passes when every receiver proves both bit for bit and the trainer sent each once. None when
    the GPUs are too few."""
    import multiprocessing as mp

    from benchmarks.weights_fanout import changed, one_version, receive
    from primerl.transport.collective import WeightSender
    from primerl.transport.offer import plan_buckets, spec_of

    if on_gpu and torch.cuda.device_count() < receivers + 1:
        return None
    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 20, generator=generator).bfloat16() for i in range(8)}  # 16 MiB
    buckets = plan_buckets([spec_of(name, tensor) for name, tensor in state.items()], 4 << 20)
    context = mp.get_context("spawn")
    pipes = [context.Pipe() for _ in range(receivers)]
    devices = [f"cuda:{1 + i}" if on_gpu else "cpu" for i in range(receivers)]
    processes = [
        context.Process(target=receive, args=(child, device), daemon=True)
        for (_, child), device in zip(pipes, devices, strict=True)
    ]
    for process in processes:
        process.start()
    conns = [parent for parent, _ in pipes]
    groups = [f"r{i}-{conn.recv()}" for i, conn in enumerate(conns)]
    with tempfile.TemporaryDirectory(prefix="primerl-gpu-relay-") as tmp:
        backend = "nccl" if on_gpu else "gloo"
        sender = WeightSender("127.0.0.1", tmp, backend, timeout_s=120, delta=True, relay=True)
        whole = one_version(sender, 1, buckets, state, groups, conns, keep=True)
        delta = one_version(sender, 2, buckets, changed(state, 0.1, seed=1), groups, conns, keep=False)
        for conn in conns:
            conn.send(None)
        for process in processes:
            process.join(timeout=60)
    size = sum(tensor.numel() * 2 for tensor in state.values())
    return {
        "relay": True,
        "backend": backend,
        "receivers": receivers,
        "passed": whole[0] == size and 0 < delta[0] < size / 3 and delta[2] == receivers,
        "whole_egress_mib": whole[0] / 2**20,
        "delta_egress_mib": delta[0] / 2**20,
        "whole_s": whole[1],
        "delta_s": delta[1],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
