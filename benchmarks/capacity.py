"""How many rollouts per second one orchestrator process sustains when the inference servers are not the limit: the
real orchestrator (`python -m primerl.orchestrator`: verifiers env, train client, dispatcher, batch writer) against
stand-in servers (benchmarks/standin_server.py) with near-zero latency, and a stand-in trainer that publishes policy
n+1 as soon as batch n is written (a weight update per batch).

    python -m benchmarks.capacity [--replicas 4] [--workers 0 1 2] [--steps 12] [--rounds 2] [--batch 256] [--env guess_number]

The orchestrator runs on core 0 and the stand-ins on core 1 (taskset), so the figures are the orchestrator's own.
Env workers are the orchestrator's children, so they share its core. Per setting: the sustained rollouts/s
(rollouts finished between the first and the last batch, over that time), the CPU ms per rollout of the
orchestrator's own process and of its env workers (psutil), the rollouts failed, cancelled and rerouted (none
expected), the rollouts in flight at the cuts, the event-loop lag and the median weight-load pause. Rounds alternate the settings; medians and ranges.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from primerl.metrics import ORCHESTRATOR, OrchestratorMetric, read_metrics
from primerl.transport.atomic import atomic_dir
from primerl.transport.identity import server_identity
from primerl.transport.run_dir import rollout_path, weights_path
from primerl.utils.process import free_port

ROOT = Path(__file__).resolve().parents[1]


def pinned(core: int | None) -> list[str]:
    """A `taskset` prefix for `core` when the machine has it and more than one core; nothing otherwise."""
    return ["taskset", "-c", str(core)] if core is not None and (os.cpu_count() or 1) > 1 else []


def start_standins(run: Path, port: int, replicas: int, core: int | None, *latency: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.standin_server", "--port", str(port), "--replicas", str(replicas)]
    cmd += ["--server-id", server_identity(run), *latency]
    server = subprocess.Popen([*pinned(core), *cmd], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    if not line.startswith("stand-in serving"):
        server.kill()
        raise RuntimeError(f"the stand-in servers did not start: {line!r}")
    return server


def orchestrator_overrides(
    run: Path, port: int, replicas: int, steps: int, batch: int, workers: int, env: str = "reverse_text"
) -> list[str]:
    return [
        "+experiment=reverse_text",
        f"env={env}",
        "sft.enabled=false",
        "eval.every=0",
        "ledger.enabled=false",
        f"inference.port={port}",
        f"inference.replicas={replicas}",
        f"trainer.max_steps={steps}",
        f"orchestrator.batch_size={batch}",
        f"orchestrator.max_inflight={2 * batch}",
        f"env.workers={workers}",
        f"output_dir={run}",
        f"hydra.run.dir={run}/logs/orchestrator",
    ]


def cpu_seconds(process: psutil.Process) -> tuple[float, float]:
    """CPU seconds (user and system) of `process` itself and of its living descendants (env workers)."""
    seconds = []
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
            seconds.append(times.user + times.system)
        except psutil.NoSuchProcess:
            seconds.append(0.0)
    return seconds[0], sum(seconds[1:])


@dataclass
class Driven:
    """What `drive` measured of the orchestrator process: CPU seconds of its own process and of its env workers
    from batch 0 to the last batch, its largest resident memory at a batch, and the seconds from its start to
    batch 0 (start-up: connecting to every replica, serving the envs, the first batch)."""

    cpu_s: float
    workers_cpu_s: float
    rss_mb: float
    first_batch_s: float


def drive(run: Path, overrides: list[str], steps: int, core: int | None, timeout_s: float = 600) -> Driven:
    """Run the orchestrator to `steps` batches, publishing policy n+1 once batch n exists (an empty STABLE weights
    directory: the stand-ins load nothing)."""
    log = open(run / "orchestrator-stdout.log", "wb")
    cmd = [*pinned(core), sys.executable, "-m", "primerl.entrypoints.orchestrator", *overrides]
    started = time.monotonic()
    orchestrator = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    watched, deadline, cpu_at, rss_mb = psutil.Process(orchestrator.pid), started + timeout_s, {}, 0.0
    first_batch_s = 0.0
    try:
        for step in range(steps):
            while not rollout_path(run, step).exists():
                if orchestrator.poll() is not None or time.monotonic() > deadline:
                    tail = (run / "orchestrator-stdout.log").read_text()[-2000:]
                    raise RuntimeError(f"the orchestrator stopped before batch {step}:\n{tail}")
                time.sleep(0.005)
            first_batch_s = first_batch_s or time.monotonic() - started
            cpu_at[step] = cpu_seconds(watched)
            rss_mb = max(rss_mb, watched.memory_info().rss / 2**20)
            with atomic_dir(weights_path(run, step + 1)):
                pass
        if orchestrator.wait(timeout=120) != 0:
            raise RuntimeError(f"the orchestrator exited with {orchestrator.returncode}")
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
        log.close()
    (main_end, workers_end), (main_start, workers_start) = cpu_at[steps - 1], cpu_at[0]
    return Driven(main_end - main_start, workers_end - workers_start, rss_mb, first_batch_s)


def measure(run: Path, driven: Driven) -> dict[str, float]:
    """Figures over batches 1..steps-1 (batch 0 includes the start)."""
    rows = read_metrics(run, ORCHESTRATOR)[1:]
    seconds = rows[-1]["time"] - read_metrics(run, ORCHESTRATOR)[0]["time"]
    rollouts = sum(r[OrchestratorMetric.ROLLOUTS_OK] + r[OrchestratorMetric.ROLLOUTS_FAILED] for r in rows)
    return {
        "rollouts_per_s": rollouts / seconds,
        "orchestrator_cpu_ms_per_rollout": 1000 * driven.cpu_s / rollouts,
        "workers_cpu_ms_per_rollout": 1000 * driven.workers_cpu_s / rollouts,
        "failed": sum(r[OrchestratorMetric.ROLLOUTS_FAILED] for r in rows),
        "cancelled": sum(r.get(OrchestratorMetric.ROLLOUTS_CANCELLED) or 0 for r in rows),
        "rerouted": sum(r.get(OrchestratorMetric.ROLLOUTS_REROUTED) or 0 for r in rows),
        "inflight": statistics.median(r[OrchestratorMetric.INFLIGHT] for r in rows),
        "loop_lag_max_ms": 1000 * max(r[OrchestratorMetric.LOOP_LAG_MAX] for r in rows),
        "weight_load_ms": 1000 * statistics.median(r[OrchestratorMetric.WEIGHT_LOAD_S] for r in rows),
        "weight_fanout_ms": 1000 * statistics.median(r.get(OrchestratorMetric.WEIGHT_FANOUT_S) or 0 for r in rows),
        "rss_mb": driven.rss_mb,
    }


def one_run(root: Path, args: argparse.Namespace, workers: int) -> dict[str, float]:
    run = Path(tempfile.mkdtemp(prefix=f"w{workers}-", dir=root))
    port = free_port(count=args.replicas)
    servers = start_standins(run, port, args.replicas, 1, "--tokens", str(args.tokens))
    try:
        overrides = orchestrator_overrides(run, port, args.replicas, args.steps, args.batch, workers, args.env)
        driven = drive(run, overrides, args.steps, 0)
    finally:
        servers.terminate()
        servers.wait(timeout=30)
    return measure(run, driven)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=256, help="rollouts per batch (orchestrator.batch_size)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8, help="completion tokens per rollout")
    parser.add_argument("--env", default="reverse_text", help="the env group (guess_number: multi-turn)")
    args = parser.parse_args()
    alternate(lambda root, workers: one_run(root, args, workers), args.workers, args.rounds, "env.workers", "capacity-")


def alternate(one, settings: list[int], rounds: int, name: str, prefix: str) -> dict[int, list[dict[str, float]]]:
    """`one(root, setting)` for each setting, `rounds` times in turn (settings alternate, so a machine's drift falls
    on all of them); prints each run, then a table of medians and ranges, and returns the figures per setting."""
    results: dict[int, list[dict[str, float]]] = {setting: [] for setting in settings}
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        for round_ in range(rounds):
            for setting in settings:
                figures = one(Path(root), setting)
                results[setting].append(figures)
                shown = ", ".join(f"{k} {v:.3g}" for k, v in figures.items())
                print(f"round {round_} {name}={setting}: {shown}", flush=True)
    keys = list(next(iter(results.values()))[0])
    print(f"\n| {name} | " + " | ".join(keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    for setting, runs in results.items():
        print(f"| {setting} | " + " | ".join(spread([r[k] for r in runs]) for k in keys) + " |")
    return results


if __name__ == "__main__":
    main()
