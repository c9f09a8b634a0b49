"""Fault injection on real processes: an environment whose reward raises, hangs or returns NaN, and an inference
server that crashes and comes back while the orchestrator is producing batches."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from primerl.metrics import read_metrics
from primerl.transport.run_dir import rollout_path
from primerl.utils.process import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _vllm_pids(port: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if any(b"vllm" in a for a in args) and str(port).encode() in args:
            pids.append(int(pid))
    return pids


def _start_inference(args: list[str], env: dict, run) -> subprocess.Popen:
    log = open(run / "inference-test.log", "ab")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen([sys.executable, "-m", "primerl.inference", *args, f"hydra.run.dir={run}/logs/inf"],
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    return process


def _wait_healthy(port: int, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "inference exited during start-up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("vLLM did not become healthy")


def test_bad_rewards_are_counted_and_a_server_crash_is_waited_out(cache_dir, tmp_path):
    run, port, steps = tmp_path / "faults", free_port(), 6
    run.mkdir()
    args = ["+experiment=reverse_text", "sft.enabled=false", "env=verifiers", "env.id=faulty-reverse-text",
            "orchestrator.batch_size=32", "orchestrator.group_size=4", "orchestrator.rollout_timeout_s=5",
            f"trainer.max_steps={steps}", f"orchestrator.async_level={steps}",  # no trainer: never wait for a policy
            f"inference.port={port}", f"output_dir={run}", "ledger.enabled=false"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'envs'}:{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    inference = _start_inference(args, env, run)
    orchestrator = None
    try:
        _wait_healthy(port, inference)
        orchestrator = subprocess.Popen([sys.executable, "-m", "primerl.orchestrator", *args,
                                         f"hydra.run.dir={run}/logs/orch"], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + 300
        while not rollout_path(run, 0).exists():
            assert orchestrator.poll() is None and time.monotonic() < deadline, orchestrator.communicate()[0][-3000:]
            time.sleep(0.1)
        # crash: kill -9 vLLM; the inference process notices and exits; a new one comes up on the same port
        for pid in _vllm_pids(port):
            if os.getpgid(pid) == pid:  # the server's process group leader: the whole server goes at once
                os.killpg(pid, signal.SIGKILL)
        assert inference.wait(timeout=60) != 0
        time.sleep(3)
        inference = _start_inference(args, env, run)
        output, _ = orchestrator.communicate(timeout=600)
    finally:
        for process in (orchestrator, inference):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
    assert orchestrator.returncode == 0, output[-3000:]
    assert "unreachable; waiting with back-off" in output
    rows = read_metrics(run, "orchestrator")
    assert [r["step"] for r in rows] == list(range(steps))  # no step lost or skipped
    assert all(rollout_path(run, s).exists() for s in range(steps))
    assert sum(r["rollouts/failed"] for r in rows) > 0 and all(r["rollouts/ok"] > 0 for r in rows)
    for reason in ("failed on purpose", "non-finite reward nan", "exceeded orchestrator.rollout_timeout_s=5"):
        assert reason in output, reason
    assert _vllm_pids(port) == []
