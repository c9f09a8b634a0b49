"""A whole RL run with `weights.transport=collective` (trainer rank 0 -> 2 vLLM-CPU replicas over gloo), through its
faults: a replica killed with -9 comes back and rejoins at the next offer; a trainer killed with -9 ends the run,
and the same command resumes it, the restarted trainer offering its checkpoint's version again to the restarted
servers. Every load's fingerprint must equal the trainer's (none is logged as different). With `weights.delta=true`:
after each start the trainer sends whole versions, then only the changed values to the replicas that proved the last
one, and whole again to a replica that came back. With `weights.relay=true` the trainer sends to one replica, which
passes each bucket on to the other."""

import os
import re
import signal
import subprocess

import pytest

from primerl.metrics import TrainerMetric, read_metrics
from primerl.transport.atomic import is_stable
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import RECEIVERS_FILE, is_offer, latest_stable_version, read_json_file
from primerl.utils.process import free_port
from tests.conftest import ROOT
from tests.test_faults import _vllm_pids, _wait_for
from tests.test_rl_e2e import _kill_child, _train_cmd

pytestmark = pytest.mark.long
REPLICAS = 2
LONG = 500  # the first run's steps: more than it reaches before its trainer is killed, however slow the restart


def test_a_collective_run_survives_a_killed_replica_and_a_killed_trainer(cache_dir, tmp_path):
    run, port = tmp_path / "collective", free_port(count=REPLICAS)
    overrides = (
        f"inference.port={port}",
        f"inference.replicas={REPLICAS}",
        "weights.transport=collective",
        "weights.bucket_mb=1",  # several buckets per version
        "weights.delta=true",  # a replica that proved the last version gets only the values that changed
        "model.dtype=bfloat16",  # served in bf16, where a step changes ~10% of the values (in fp32: all)
        "weights.relay=true",  # the trainer sends to one replica, which passes each bucket on
        "eval.every=0",
        "ledger=none",
    )
    orchestrator_log = run / "logs" / "orchestrator.log"
    train = subprocess.Popen(
        _train_cmd(run, *overrides, steps=LONG), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(read_metrics(run, "trainer")) >= 2, "2 trainer steps", train, 600)
        for pid in _vllm_pids(port):  # replica 0's whole server, mid-run
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        _wait_for(lambda: f"127.0.0.1:{port} is back" in orchestrator_log.read_text(), "replica 0 back", train, 600)
        back_at = len(read_metrics(run, "trainer"))
        _wait_for(lambda: len(read_metrics(run, "trainer")) >= back_at + 2, "2 steps with both replicas", train, 600)
        _kill_child(train, run, "primerl.entrypoints.trainer")
    finally:
        if train.poll() is None:
            train.kill()
    first_log = orchestrator_log.read_text()
    assert re.search(r"the server serves policy v0; v\d+ went by collective: it joins the next offer", first_log)

    # the same command resumes it, shortened to 4 steps past where it stopped
    steps = len(read_metrics(run, "trainer")) + 4
    shorter = (*overrides, "allow_changes=[trainer.max_steps]")
    result = subprocess.run(
        _train_cmd(run, *shorter, steps=steps), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run, "trainer")
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r[TrainerMetric.WEIGHTS_FINGERPRINT] for r in rows)  # every published version has one
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert trainer_log.count("collective weights: rendezvous in ") == 2  # one sender per trainer start
    sent_mib = {
        int(deltas): float(mib)
        for mib, deltas in re.findall(
            r"v\d+ sent to 2 replica group\(s\) in [\d.]+s \(\d+ bucket\(s\), ([\d.]+) MiB, deltas to (\d)\)",
            trainer_log,
        )
    }
    # whole after each start, then deltas to both; to one only when the replica killed came back. Relayed, the
    # trainer sends a version once per chain: 1.6 MiB whole (not 3.1 as to each replica), a delta chain and a whole
    # one when only one replica takes deltas
    assert sent_mib.keys() == {0, 1, 2}, sent_mib
    assert sent_mib[0] < 2 and sent_mib[2] < sent_mib[0] / 3 and sent_mib[0] < sent_mib[1] < 2 * sent_mib[0], sent_mib
    assert "serves fingerprint" not in orchestrator_log.read_text()  # every load proved what it serves
    # the last version is the run's product: whole weights on disk; the ones before it went by collective
    assert latest_stable_version(run) == steps and not is_offer(weights_path(run, steps))
    sent = [v for v in range(1, steps) if is_stable(weights_path(run, v))]
    assert sent and all(is_offer(weights_path(run, v)) for v in sent)
    answers = [read_json_file(weights_path(run, v) / RECEIVERS_FILE)["groups"] for v in sent]
    assert any(sorted(name.split("-")[0] for name in groups) == ["r0", "r1"] for groups in answers), answers
    assert all(set(groups.values()) <= {2} for groups in answers)  # trainer rank 0 + the replica's one worker
