"""Inference replicas: samples/s with 1 and 2 vLLM replicas on the same work, and the cost of a weight update.

    python -m benchmarks.replicas [--rounds 3] [--hidden 512] [--max-tokens 64] [--tasks 16]

Two vLLM-CPU servers of a random tiny Qwen3 (`--hidden`, so that generation dominates; rollouts run to
`--max-tokens`), each pinned to its own core (process affinity and vLLM's OMP binding), started once. Each round runs
the same number of primerl-reverse-text rollouts (`--tasks` x group 8, T=1) through primerl's rollout path (verifiers env,
train client, `ReplicaRunner` spreading by least outstanding) against replica 0 alone, then against both; rounds
alternate and the medians are printed with their ratio. The orchestrator process floats over both cores in both
cases. Then the weight update: a published checkpoint loaded in flight (pause, load, resume) into 1 and into both
replicas at once, as the watcher does (median of 5 each).
"""

import argparse
import asyncio
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.inference import arch_overrides
from primerl.app import check
from primerl.envs.types import Rollout
from primerl.envs.verifiers_env import env_runner, load_env
from primerl.inference.server import VllmServer
from primerl.inference.vllm_args import render_specs
from primerl.launch.start import prepare_start_model
from primerl.orchestrator.inference_client import InferenceClient
from primerl.orchestrator.replicas import ReplicaRunner, Replicas
from primerl.trainer.weights import save_hf_checkpoint
from primerl.transport.run_dir import weights_path
from primerl.utils.process import free_port


async def samples_per_s(cfg, env, clients, tasks, n_tasks: int, group: int) -> tuple[float, int]:
    orch = cfg.orchestrator
    model = prepare_start_model(cfg)
    replicas = Replicas(clients)
    runners = [
        env_runner(env, model, cfg.inference, orch.temperature, orch.max_tokens, None, c.base_url) for c in clients
    ]
    runner = ReplicaRunner(runners, replicas)
    batch = list(itertools.islice(tasks, n_tasks))
    started = time.perf_counter()
    results = await asyncio.gather(*(runner.run(task) for task in batch for _ in range(group)))
    seconds = time.perf_counter() - started
    ok = sum(any(isinstance(e, Rollout) for e in entries) for entries in results)
    return ok / seconds, ok


async def bench(cfg, clients: list[InferenceClient], rounds: int, n_tasks: int, published: Path) -> None:
    env = load_env(cfg.env)
    tasks = iter(env.taskset)
    group = cfg.orchestrator.group_size
    rates: dict[int, list[float]] = {1: [], 2: []}
    async with env.serving():
        for r in range(rounds + 1):  # round 0 warms both replicas up and is not counted
            for n in (1, 2):
                rate, ok = await samples_per_s(cfg, env, clients[:n], tasks, n_tasks, group)
                if r:
                    rates[n].append(rate)
                print(
                    f"round {r}{' (warm-up)' if not r else ''}: {n} replica{'s' if n > 1 else ''}: {ok} samples, "
                    f"{rate:.2f} samples/s",
                    flush=True,
                )
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(
        f"\nsamples/s (median of {rounds}; range): 1 replica {one:.2f} ({min(rates[1]):.2f}-{max(rates[1]):.2f}), "
        f"2 replicas {two:.2f} ({min(rates[2]):.2f}-{max(rates[2]):.2f}), ratio {two / one:.2f}x"
    )
    version = itertools.count(1)
    for n in (1, 2):
        times = []
        for _ in range(5):
            v = next(version)
            started = time.perf_counter()
            await asyncio.gather(*(c.load_weights(published, v) for c in clients[:n]))
            times.append(time.perf_counter() - started)
        print(
            f"weight update into {n} replica{'s' if n > 1 else ''} at once: median {statistics.median(times):.3f} s "
            f"(range {min(times):.3f}-{max(times):.3f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tasks", type=int, default=16)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-replicas-"))
    cfg = check(
        [
            "+experiment=reverse_text",
            "sft.enabled=false",
            f"cache_dir={root / 'cache'}",
            f"output_dir={root}",
            f"inference.port={free_port(count=2)}",
            "inference.replicas=2",
            *arch_overrides(args.hidden),
            f"orchestrator.max_tokens={args.max_tokens}",
        ]
    )
    model = prepare_start_model(cfg)
    from safetensors.torch import load_file

    published = save_hf_checkpoint(load_file(Path(model) / "model.safetensors"), model, weights_path(root, 1))
    servers = []
    for spec in render_specs(cfg, model, "cpu"):  # each replica's OpenMP threads on its own core
        server = VllmServer(spec, root / f"vllm-{spec.port}.log")
        server.spawn()
        cores = {int(c) for c in spec.env["VLLM_CPU_OMP_THREADS_BIND"].split(",")}
        os.sched_setaffinity(server.process.pid, cores)  # the whole server there, before vLLM forks its engine core
        servers.append(server)
    try:
        for server in servers:
            server.wait_ready(600)

        async def run() -> None:
            clients = [InferenceClient(s.base_url) for s in servers]
            try:
                await bench(cfg, clients, args.rounds, args.tasks, published)
            finally:
                for client in clients:
                    await client.close()

        asyncio.run(run())
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
