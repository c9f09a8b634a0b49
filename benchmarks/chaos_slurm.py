"""Chaos soak on the multi-node SLURM test cluster: the faults only a cluster has, on a real run under `launcher=slurm`.

    python -m benchmarks.chaos_slurm [--steps 40] [--faults 2] [--seed 0] [--keep DIR]

Needs root and network namespaces: it starts (or reuses) `PRIMERL_SLURM_NODES=3 launchers/slurm/cluster.sh`, three
nodes each in its own namespace, as the multi-node tests do. One reverse_text run (random tiny model, batch 16,
async_level 1, the ledger in a sqlite store): orchestrator and trainer jobs on node1, one inference job on node2 or
node3. Each fault comes after the trainer finished one more step and a seeded random 0-4 s; every kind at least once,
in a seeded order:
- `driver`: kill -9 of the driver, on this machine. Its jobs run on the nodes, not as its children: each stops by
  itself once the driver's lease lapses (`launcher.driver_lease_s`, 30 s here; primerl.launch.lease). Timed: the kill
  to the last job of the run out of the queue and the last process of the run gone, against LEASE_S + LEASE_SLACK_S.
  Then the same command is rerun, as a user would, and resumes.
- `node_lost`: the node that serves the inference job is lost whole (`cluster.sh lose-node`: its link cut, every
  process in its namespace killed -9, its slurmd included). slurmctld marks it DOWN after SlurmdTimeout (30 s on the
  test cluster) and requeues the job onto the other free node; the orchestrator waits for the replica's new address
  and follows it. Recorded: whether the run went on by itself (4 more trained steps) and how long that took (bound:
  NODE_LOST_BOUND_S), or how the driver ended; then the node is restored (`cluster.sh restore-node`) and, if the run
  stopped, it is rerun.
Afterwards it checks: the run finished (exit 0); the checks of benchmarks/chaos.py on steps and batches (every step
trained once, every batch consumed once, every drawn task once, nothing rewound); each driver kill's jobs gone within
the bound; the run went on through each lost node; no job of the run left in the queue and no process of the run
left; three nodes up at the end. Exit status 1 if any check fails.
"""

import argparse
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.chaos_checks import check_steps
from benchmarks.chaos_faults import ROOT, wait_for
from primerl.launch.leftovers import run_processes
from primerl.metrics import TRAINER, read_metrics
from primerl.utils.secrets import API_KEY_ENV

KINDS = ("driver", "node_lost")
NODES = 3
CLUSTER = ROOT / "launchers" / "slurm" / "cluster.sh"
CLUSTER_ENV = {"PRIMERL_SLURM_NODES": str(NODES), "PRIMERL_SLURM_DIR": f"/tmp/primerl-slurm-{NODES}"}
LEASE_S = 30.0  # launcher.driver_lease_s: its lower bound
LEASE_SLACK_S = 60.0  # past the lease: the jobs' 1 s check, the process's stop grace, SLURM ending the job
# a lost node to 4 more trained steps: SlurmdTimeout 30 s and up to a third of it more to notice, the requeued job's
# start (cred_expire 10 s), its server's start (~60 s on a loaded 2-core machine), the version's load, 4 steps
NODE_LOST_BOUND_S = 180.0


def slurm(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout


def cluster(*args: str) -> str:
    done = subprocess.run(
        [str(CLUSTER), *args], capture_output=True, text=True, timeout=900, env={**os.environ, **CLUSTER_ENV}
    )
    if done.returncode != 0:
        raise SystemExit(f"cluster.sh {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
    return done.stderr.strip()


class SlurmSoak:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.run = work / "soak"
        self.cmd = [
            sys.executable,
            "-m",
            "primerl.train",
            "+experiment=reverse_text",
            "launcher=slurm",
            "launcher.poll_s=1",
            f"launcher.driver_lease_s={LEASE_S:g}",
            "sft.enabled=false",
            f"trainer.max_steps={args.steps}",
            "orchestrator.batch_size=16",
            "orchestrator.group_size=4",
            "inference.port=0",
            "inference.host=0.0.0.0",
            '+launcher.sbatch.trainer.exclude="node[2-3]"',
            '+launcher.sbatch.orchestrator.exclude="node[2-3]"',
            "+launcher.sbatch.inference.exclude=node1",
            f"hydra.run.dir={self.run}",
            f"ledger.store_dir={work / 'ledger'}",
        ]
        rng = self.rng = random.Random(args.seed)
        self.plan = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, args.faults - len(KINDS)))]
        rng.shuffle(self.plan)
        self.faults: list[dict] = []
        self.incarnations = 0
        self.driver: subprocess.Popen | None = None
        self.jobs: set[str] = set()
        # the servers bind every address of their node: they need a key, given in the environment, not in argv
        self.env = {**os.environ, API_KEY_ENV: secrets.token_hex(16)}

    def steps(self) -> int:
        return len(read_metrics(self.run, TRAINER))

    def log(self) -> Path:
        return self.work / f"driver-{self.incarnations}.log"

    def start_driver(self) -> None:
        self.incarnations += 1
        with open(self.log(), "w") as out:
            self.driver = subprocess.Popen(
                self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )

    def job_ids(self) -> dict[str, str]:
        """This incarnation's jobs by name, as its driver announced them."""
        found = dict(re.findall(r"train: ([\w-]+) is SLURM job (\d+)", self.log().read_text()))
        self.jobs |= set(found.values())
        return found

    def queued(self) -> list[str]:
        """The run's jobs still in the queue (any incarnation's)."""
        return [j for j in slurm("squeue", "-h", "-o", "%i").split() if j in self.jobs]

    def wait_for_step(self, step: int, timeout_s: float = 900) -> None:
        """Until `step` steps are trained or the driver ended."""
        wait_for(lambda: self.steps() >= step or self.driver.poll() is not None, timeout_s, poll_s=1)

    def go(self) -> float:
        started = time.monotonic()
        while True:
            if self.driver is None:
                self.start_driver()
            kind = self.plan[len(self.faults)] if len(self.faults) < len(self.plan) else None
            if kind is None:
                self.driver.wait(timeout=1800)
                return time.monotonic() - started
            self.wait_for_step(self.steps() + 1)
            time.sleep(self.rng.uniform(0, 4))
            if self.driver.poll() is not None:
                raise SystemExit(f"incarnation {self.incarnations} ended with {self.driver.returncode} before {kind}")
            self.job_ids()
            fault = self.kill_driver() if kind == "driver" else self.lose_node()
            self.faults.append(fault)
            print(f"fault {len(self.faults)}: {json.dumps(fault)}", flush=True)

    def kill_driver(self) -> dict:
        step = self.steps()
        os.kill(self.driver.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.driver.wait()
        bound = LEASE_S + LEASE_SLACK_S
        gone = wait_for(lambda: not self.queued() and not run_processes(self.run), bound + 120, poll_s=1)
        self.driver = None
        return {
            "kind": "driver",
            "at_step": step,
            "jobs_gone_s": round(time.monotonic() - killed_at, 1) if gone else None,
            "bound_s": bound,
        }

    def lose_node(self) -> dict:
        step = self.steps()
        inference = self.job_ids()["inference"]
        node = slurm("squeue", "-h", "-j", inference, "-o", "%N").strip()
        cluster("lose-node", node.removeprefix("node"))
        lost_at = time.monotonic()
        target = min(step + 4, self.args.steps)
        self.wait_for_step(target)
        fault = {
            "kind": "node_lost",
            "node": node,
            "at_step": step,
            "went_on": self.steps() >= target and self.driver.poll() in (None, 0),
            "recovered_s": round(time.monotonic() - lost_at, 1),
            "inference_states": slurm("sacct", "-n", "-X", "-D", "-P", "-j", inference, "-o", "State,NodeList")
            .strip()
            .splitlines(),
        }
        if self.driver.poll() is not None:  # the run stopped: what the driver said, then a rerun
            fault["driver_exit"] = self.driver.returncode
            lines = self.log().read_text().strip().splitlines()
            fault["driver_said"] = next((line for line in lines if " ERROR " in line), lines[-1])[:300]
            wait_for(lambda: not self.queued() and not run_processes(self.run), 300, poll_s=1)
            self.driver = None
        cluster("restore-node", node.removeprefix("node"))
        return fault

    def stop(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            os.killpg(self.driver.pid, signal.SIGTERM)
            self.driver.wait(timeout=120)
        if self.jobs:
            slurm("scancel", *self.jobs)
        for pid in run_processes(self.run):
            os.kill(pid, signal.SIGKILL)


def checks(soak: SlurmSoak) -> list[tuple[str, bool, str]]:
    run, faults = soak.run, soak.faults
    out = [("the run finished", soak.driver is not None and soak.driver.returncode == 0, f"{soak.incarnations} runs")]
    out += check_steps(run, soak.args.steps, faults)
    kills = [f for f in faults if f["kind"] == "driver"]
    out.append(
        (
            "each killed driver's jobs and processes gone within the lease's bound",
            all(f["jobs_gone_s"] is not None and f["jobs_gone_s"] <= f["bound_s"] for f in kills),
            ", ".join(f"{f['jobs_gone_s']} s (bound {f['bound_s']:g} s)" for f in kills) or "none",
        )
    )
    lost = [f for f in faults if f["kind"] == "node_lost"]
    out.append(
        (
            f"the run went on through each lost node, 4 more steps within {NODE_LOST_BOUND_S:g} s",
            all(f["went_on"] and f["recovered_s"] <= NODE_LOST_BOUND_S for f in lost),
            ", ".join(f"{f['node']}: {f['recovered_s']} s" for f in lost) or "none",
        )
    )
    wait_for(lambda: not soak.queued(), 60, poll_s=1)
    out.append(("no job of the run left in the queue", not soak.queued(), str(soak.queued() or "none")))
    out.append(("no process of the run left", not run_processes(run), str(run_processes(run) or "none")))
    up = slurm("sinfo", "-h", "-N", "--responding", "-o", "%N %T").split("\n")
    out.append(("every node back in service", len([u for u in up if u.strip()]) == NODES, "; ".join(up).strip()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--faults", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the run directory under this directory")
    args = parser.parse_args()
    print(cluster("start"), flush=True)
    os.environ["SLURM_CONF"] = f"{CLUSTER_ENV['PRIMERL_SLURM_DIR']}/etc/slurm.conf"
    work = Path(args.keep or tempfile.mkdtemp(prefix="primerl-chaos-slurm-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = SlurmSoak(args, work)
    try:
        wall_s = soak.go()
    finally:
        soak.stop()
    results = checks(soak)
    print(f"\n{args.steps} steps, {len(soak.faults)} faults, {soak.incarnations} runs, {wall_s:.0f} s; run {soak.run}")
    for name, ok, detail in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    summary = {"faults": soak.faults, "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in results]}
    (work / "chaos_slurm.json").write_text(json.dumps(summary, indent=1, default=str))
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
