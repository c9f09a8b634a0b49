"""Runs through a real SLURM cluster on this machine (`launchers/slurm/cluster.sh`: munge, MariaDB + slurmdbd,
slurmctld, slurmd; tests.conftest.slurm_cluster, shared with tests/test_slurm_multinode.py, which has preemption, a
requeued server and a trainer on two nodes)."""

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import ROOT, run_module, sweep_children

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def slurm(slurm_cluster) -> list[str]:
    """The overrides a run needs on the session's cluster: with several nodes (each its own network namespace) the
    orchestrator reaches inference on another node's address, which takes a key."""
    return [] if slurm_cluster == 1 else ["inference.host=0.0.0.0", "inference.api_key=test-key"]


def _slurm(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def _states(job_id: str) -> list[str]:
    """Every accounting record of the job, oldest first (a requeued job has one per start)."""
    out = _slurm("sacct", "-n", "-X", "-D", "-P", "-j", job_id, "-o", "State")
    return [line.split(" ")[0] for line in out.splitlines() if line]


@contextlib.contextmanager
def _driver(run: Path, *overrides: str, steps: int):
    """`primerl.train launcher=slurm ...` in the background, yielding (process, its output file); killed if still
    alive on the way out."""
    out = run.parent / f"{run.name}.out"
    cmd = [
        sys.executable,
        "-m",
        "primerl.train",
        "+experiment=reverse_text",
        "launcher=slurm",
        "launcher.poll_s=1",
        "sft.enabled=false",
        f"trainer.max_steps={steps}",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        "inference.port=0",
        f"hydra.run.dir={run}",
        f"ledger.store_dir={run.parent / 'ledger'}",
        *overrides,
    ]
    with open(out, "w") as f:
        driver = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        yield driver, out
    finally:
        if driver.poll() is None:
            driver.kill()


def _job_ids(out: Path, timeout: float = 120, roles: tuple[str, ...] = ("inference",)) -> dict[str, str]:
    """The run's SLURM job ids by job name, once the driver named the orchestrator's, the trainer's and `roles`'."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = dict(re.findall(r"train: ([\w-]+) is SLURM job (\d+)", out.read_text()))
        if {*roles, "orchestrator", "trainer"} <= set(ids):
            return ids
        time.sleep(0.5)
    raise AssertionError(out.read_text()[-3000:])


def _wait_for_states(jobs: dict[str, str], expected: dict[str, list[str]], timeout: float = 60) -> None:
    """SLURM's books catch up a moment after the driver exits (a cancelled job is still completing)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {name: _states(job) for name, job in jobs.items()}
        queued = _slurm("squeue", "-h", "-o", "%i %T").split("\n")[:-1]
        if seen == expected and not queued:
            return
        assert time.monotonic() < deadline, (seen, queued)
        time.sleep(1.0)


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(1.0)


def test_cancelled_job_stops_the_whole_run(slurm, cache_dir, tmp_path):
    run = tmp_path / "cancelled"
    with _driver(run, *slurm, steps=20) as (driver, out):
        jobs = _job_ids(out)
        _wait(
            lambda: _slurm("squeue", "-h", "-j", jobs["orchestrator"], "-o", "%T").strip() == "RUNNING",
            300,
            "the orchestrator job never ran",
        )
        _slurm("scancel", jobs["orchestrator"])
        driver.wait(timeout=180)
    text = out.read_text()
    assert driver.returncode == 1, text[-3000:]
    assert f"orchestrator (SLURM job {jobs['orchestrator']}) ended CANCELLED" in text
    _wait_for_states(jobs, {name: ["CANCELLED"] for name in jobs})
    record = json.loads((run / "ledger.json").read_text())
    assert MlflowClient(record["tracking_uri"]).get_run(record["run_id"]).info.status == "FAILED"


@pytest.mark.long
def test_two_job_sweep_through_submitit_slurm(slurm, cache_dir, tmp_path):
    sweep, store = tmp_path / "sweep", tmp_path / "store"
    # each sweep point is one SLURM job (an array task) running the whole topology on its node; two run at once,
    # so each takes a free port for its inference server
    result = run_module(
        "primerl.train",
        "-m",
        "hydra/launcher=submitit_slurm",
        "+experiment=reverse_text",
        "sft.enabled=false",
        "trainer.max_steps=1",
        "orchestrator.batch_size=8",
        "orchestrator.group_size=4",
        "trainer.optim.lr=1e-4,2e-4",
        "inference.port=0",
        "hydra.launcher.timeout_min=30",
        "hydra.launcher.cpus_per_task=2",
        f"hydra.sweep.dir={sweep}",
        f"ledger.store_dir={store}",
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    children = sweep_children(store, sweep, ["0.0001", "0.0002"])
    array_ids = {r.data.tags["slurm.array_job_id"] for r in children}
    assert len(array_ids) == 1 and sorted(r.data.tags["slurm.array_task_id"] for r in children) == ["0", "1"]
    array = array_ids.pop()  # the jobs end in SLURM's books a moment after their results are back
    _wait(lambda: [_states(f"{array}_{i}") for i in (0, 1)] == [["COMPLETED"]] * 2, 60, "sweep jobs did not complete")
