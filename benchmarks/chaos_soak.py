"""The chaos soak's run (benchmarks/chaos.py): its command, its faults in a seeded order, the reruns after each
kill, and what each fault did."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.chaos_faults import (
    ROOT,
    RolloutsDisk,
    TrackingServer,
    cmdline,
    damage_newest_checkpoint,
    failpoint_env,
    target_pid,
    tear_samples_line,
    wait_for,
)
from benchmarks.chaos_ridden import inject
from primerl.launch.leftovers import run_processes
from primerl.metrics import TRAINER, read_metrics
from primerl.utils.process import free_port

# the run stops; the user reruns it (torn_samples and damaged_checkpoint: kill -9 of the orchestrator, of the trainer,
# then the damage a kill or a shared filesystem can leave; store_down_at_start: kill -9 of the driver, then the rerun
# meets its tracking server down; dies_at_first_request: kill -9 of the vLLM server while every start of it dies at its
# first request, until the inference process gives up and the run stops with the error quoted)
STOPPING = (
    "trainer",
    "orchestrator",
    "inference",
    "driver",
    "torn_samples",
    "damaged_checkpoint",
    "store_down_at_start",
    "dies_at_first_request",
)
DIES = "server.dies_at_first_request"
RIDDEN = ("vllm", "nan_step", "store_down", "store_locked", "disk_full", "second_run", "slow_env", "vllm_mid_transfer")
KINDS = STOPPING + RIDDEN
SAMPLE_EVERY = 5


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
        asked = args.kinds.split(",") if args.kinds else KINDS
        kinds = [k for k in asked if k != "disk_full" or self.disk.available]
        if args.transport == "collective":
            # several buckets per version; two replicas, so that a killed one can take the next offer while the
            # other serves (with every replica lost, a version sent by collective is nowhere: the run stops)
            self.cmd += ["weights.transport=collective", "weights.bucket_mb=1", "inference.replicas=2"]
            self.cmd[self.cmd.index(next(a for a in self.cmd if a.startswith("inference.port=")))] = (
                f"inference.port={free_port(count=2)}"
            )
        elif "vllm_mid_transfer" in kinds:
            kinds.remove("vllm_mid_transfer")
        if args.pd:  # each replica a prefill and a decode server behind a router (on a free port): four servers
            ports = free_port(count=4)
            self.cmd = [a for a in self.cmd if not a.startswith("inference.port=")] + [
                "inference.port=0",
                "inference.pd.enabled=true",
                "inference.pd.kv_connector=ExampleConnector",
                f"inference.pd.prefill_port={ports}",
                f"inference.pd.decode_port={ports + 2}",
            ]
        self.cmd += args.set  # the user's own overrides come last, so they win
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
        if kind == "dies_at_first_request":
            self.failpoints.mkdir(parents=True, exist_ok=True)
            (self.failpoints / DIES).touch()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        if kind == "dies_at_first_request":  # ~3 starts of ~40 s, each dying at its first request, then the stop
            self.driver.wait(timeout=900)
            (self.failpoints / DIES).unlink(missing_ok=True)
            killed_at = time.monotonic()  # what is timed below: the stop after the inference process gave up
        self.driver.wait(timeout=300)
        # the driver is gone; the run's processes must follow (SIGTERM by parent death, or stopped by the driver)
        wait_for(lambda: not run_processes(self.run), 60)
        left = run_processes(self.run)
        self.orphans += [f"after killing {kind}: {cmdline(p)[:80]!r}" for p in left]
        for p in left:
            os.kill(p, signal.SIGKILL)
        if kind == "torn_samples":
            tear_samples_line(self.run)
        fault = {
            "kind": kind,
            "at_step": step,
            "driver_exit": self.driver.returncode,
            "stopped_s": round(time.monotonic() - killed_at, 1),
        }
        self.driver = None
        if kind == "damaged_checkpoint":
            fault["damage"] = self.rng.choice(["truncated", "missing"])
            damage_newest_checkpoint(self.run, missing=fault["damage"] == "missing")
        if kind == "store_down_at_start":
            fault["waited_for_store"] = self.rerun_without_store()
        if kind == "dies_at_first_request":
            fault["quoted"] = f"failpoint {DIES}" in Path(self.work / f"driver-{self.incarnations}.log").read_text()
        self.faults.append(fault)
        extra = "".join(f"; {k} {fault[k]}" for k in ("damage", "waited_for_store", "quoted") if k in fault)
        print(
            f"fault {len(self.faults)}: {kind} at step {step}; driver exit {fault['driver_exit']}; "
            f"everything stopped after {fault['stopped_s']} s{extra}",
            flush=True,
        )
        return True

    def rerun_without_store(self) -> bool:
        """Rerun with the tracking server down; start it again once the driver says it waits for it (the
        wait is `ledger.connect_timeout_s`, 60 s). Whether the driver waited and then found it."""
        self.server.kill()
        self.start_driver()
        log = Path(self.driver_log.name)
        waited = wait_for(lambda: "does not answer; waiting" in log.read_text() or not self.alive(), 300)
        time.sleep(self.rng.uniform(0, 10))
        self.server.start()
        found = wait_for(lambda: "answers" in log.read_text().split("does not answer")[-1], 120)
        return waited and found and self.alive()

    def ride(self, kind: str) -> None:
        """Inject a fault the run must go on through; then wait for four more trained steps."""
        step = self.steps()
        began = time.monotonic()
        fault = {"kind": kind, "at_step": step, "stopped_s": None}
        back_before = self.returns()
        fault |= inject(self, kind)
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
