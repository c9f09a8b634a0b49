"""The orchestrator's control plane as the replica count grows: the real orchestrator against R stand-in replicas
(benchmarks/standin_server.py, all in one process on their own core) with a stand-in trainer publishing a version
per batch (benchmarks/capacity.py `drive`), for each R given.

    python -m benchmarks.control_plane [--replicas 4 64 256 1024] [--steps 8] [--batch 256] [--workers 1] [--rounds 1]
        [--load-s 0] [--fail-one-at 0]

Per R: rollouts/s; the orchestrator's CPU ms per rollout (its own process, pinned to core 0); per batch (median), the
slowest replica's pause for the weight load and the version's fan-out (first load request to every replica serving
it; each stand-in load takes `--load-s`);
the event loop's worst lag; its largest resident memory; its start-up (process start to batch 0); and the requests
each route of the replicas received per batch, summed over replicas (health checks, the idle gauge's /metrics,
weight loads and pauses): what grows with R. With `--fail-one-at V`, the last replica fails (answers 503) 1 s after it
loaded version V: the seconds rollouts were still sent to it afterwards, and the rollouts rerouted.
Rounds alternate the replica counts; medians and ranges.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.capacity import alternate, drive, measure, orchestrator_overrides, start_standins
from primerl.utils.process import free_port

ROUTES = {"/health": "health", "/metrics": "metrics", "/collective_rpc": "rpc", "/pause": "pause"}


def one_run(root: Path, args: argparse.Namespace, replicas: int) -> dict[str, float]:
    run = Path(tempfile.mkdtemp(prefix=f"r{replicas}-", dir=root))
    port, stats = free_port(count=replicas), run / "standin.json"
    standin = ["--tokens", str(args.tokens), "--stats", str(stats), "--load-s", str(args.load_s)]
    standin += ["--last-fails-after-loads", str(args.fail_one_at)]
    servers = start_standins(run, port, replicas, 1, *standin)
    try:
        overrides = orchestrator_overrides(run, port, replicas, args.steps, args.batch, args.workers)
        driven = drive(run, overrides, args.steps, 0, timeout_s=args.timeout_s)
        time.sleep(1.5)  # the stand-ins write their counts each second
        counts = json.loads(stats.read_text())
    finally:
        servers.terminate()
        servers.wait(timeout=60)
    figures = measure(run, driven)
    keep = ("rollouts_per_s", "orchestrator_cpu_ms_per_rollout", "weight_load_ms", "weight_fanout_ms")
    keep += ("loop_lag_max_ms", "rss_mb")
    out = {key: figures[key] for key in keep} | {"first_batch_s": driven.first_batch_s}
    for route, name in ROUTES.items():
        out[f"{name}_per_batch"] = counts["requests"].get(route, 0) / args.steps
    if args.fail_one_at:
        failed = counts["replicas"][-1]
        routed_after = (failed["generate_after_failure"] or failed["failed_at"]) - failed["failed_at"]
        out |= {"routed_after_failure_s": routed_after, "rerouted": figures["rerouted"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256, help="rollouts per batch (orchestrator.batch_size)")
    parser.add_argument("--tokens", type=int, default=8, help="completion tokens per rollout")
    parser.add_argument("--workers", type=int, default=1, help="env.workers (the orchestrator's own cost: 1)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--load-s", type=float, default=0.0, help="seconds each stand-in takes to load weights")
    parser.add_argument("--fail-one-at", type=int, default=0, help="the last replica fails after this version")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()
    results = alternate(
        lambda root, replicas: one_run(root, args, replicas), args.replicas, args.rounds, "replicas", "control-plane-"
    )
    if len(results) > 1 and all(results.values()):
        low, high = min(results), max(results)
        ratio = statistics.median(r["orchestrator_cpu_ms_per_rollout"] for r in results[high]) / statistics.median(
            r["orchestrator_cpu_ms_per_rollout"] for r in results[low]
        )
        print(f"\norchestrator CPU per rollout at {high} replicas: {ratio:.2f}x that at {low}")


if __name__ == "__main__":
    main()
