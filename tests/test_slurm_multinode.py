"""A run across a real 3-node SLURM cluster on this machine (`PRIMERL_SLURM_NODES=3 launchers/slurm/cluster.sh`):
each node's slurmd in its own network namespace with its own address on a bridge, the controller in another
(tests.conftest.slurm_cluster, shared with tests/test_slurm.py)."""

import json
import os
import re
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from primerl.metrics import read_metrics
from tests.conftest import SLURM_CLUSTER, SLURM_NODES
from tests.test_slurm import _driver, _job_ids, _slurm, _wait, _wait_for_states

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]


@pytest.fixture(scope="module")
def slurm_nodes(slurm_cluster):
    if slurm_cluster < SLURM_NODES:  # the cluster needs root and network namespaces
        pytest.skip("no network namespaces here: the SLURM cluster has one node")


def _node_of(job_id: str) -> str:
    return _slurm("squeue", "-h", "-j", job_id, "-o", "%N").strip()


def _state(job_id: str) -> str:
    return _slurm("squeue", "-h", "-j", job_id, "-o", "%T").strip()


def _cluster(*args: str) -> None:
    env = {
        **os.environ,
        "PRIMERL_SLURM_NODES": str(SLURM_NODES),
        "PRIMERL_SLURM_DIR": f"/tmp/primerl-slurm-{SLURM_NODES}",
    }
    done = subprocess.run([str(SLURM_CLUSTER), *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr


def test_trainer_on_two_nodes_survives_a_preemption_and_a_lost_node_whose_server_comes_back_on_another(
    slurm_nodes, cache_dir, tmp_path
):
    """FSDP2 over gloo between two nodes' namespaces (node1, node2); two inference jobs, one replica each, on the
    third node (placed there by `launcher.sbatch`). Then, at once, the trainer is preempted (USR2, it requeues itself
    and resumes from its checkpoint) and the third node is lost whole (`cluster.sh lose-node`: its link cut, every
    process on it killed -9). slurmctld marks it down and requeues both inference jobs; the driver goes on (sacct may
    still say NODE_FAIL: the queue decides). The first is let off the lost node, so it comes back on another one; the
    node is restored, and the second comes back there. The orchestrator follows both. Every step is trained once."""
    run = tmp_path / "run"
    overrides = [
        "launcher.trainer_nodes=2",
        "inference.host=0.0.0.0",
        "inference.api_key=test-key",
        "inference.replicas=2",
        "launcher.inference_jobs=2",
        "+launcher.sbatch.trainer.exclude=node3",
        "+launcher.sbatch.orchestrator.exclude=node3",  # it lives through the loss, and follows the servers
        '+launcher.sbatch.inference.exclude="node[1-2]"',
    ]
    # the run must outlast the lost node's notice (~30-60 s) and a server's return; steps take ~1 s here
    steps = 24
    with _driver(run, *overrides, steps=steps) as (driver, out):
        jobs = _job_ids(out)
        _wait(lambda: len(read_metrics(run, "trainer")) >= 2 or driver.poll() is not None, 600, out.read_text())
        first_node = _node_of(jobs["inference"])
        placed = {name: _node_of(jobs[name]) for name in ("trainer", "inference", "inference-1")}
        _slurm("scancel", "--signal=USR2", jobs["trainer"])
        _cluster("lose-node", first_node.removeprefix("node"))
        # SlurmdTimeout (30 s on the test cluster), then both jobs are requeued: pending, the lost node down
        requeued = lambda: all(_state(jobs[n]) in ("PENDING", "REQUEUED") for n in ("inference", "inference-1"))  # noqa: E731
        _wait(lambda: requeued() or driver.poll() is not None, 300, out.read_text())
        _slurm("scontrol", "update", f"JobId={jobs['inference']}", f"ExcNodeList={first_node}")
        _cluster("restore-node", first_node.removeprefix("node"))
        driver.wait(timeout=900)
    text = out.read_text()
    assert driver.returncode == 0, text[-4000:]
    assert [r["step"] for r in read_metrics(run, "trainer")] == list(range(steps))  # every step once
    assert [r["step"] for r in read_metrics(run, "orchestrator")] == list(range(steps))
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "on 2 rank(s)" in trainer_log and (run / "logs" / "trainer-rank1.log").exists()
    resumed = re.findall(r"starting at step (\d+) from \S+checkpoints", trainer_log)
    assert resumed and int(resumed[0]) >= 1, trainer_log[-2000:]  # step 2's checkpoint may have been in flight
    nodes = _slurm("sacct", "-n", "-X", "-D", "-P", "-j", jobs["trainer"], "-o", "NNodes").split()
    assert nodes and set(nodes) == {"2"}  # both starts of the trainer spanned two nodes
    assert placed == {"trainer": "node[1-2]", "inference": "node3", "inference-1": "node3"}, placed
    orchestrator_log = (run / "logs" / "orchestrator.log").read_text()
    moved = re.search(r"inference replica 0 moved: http://(\S+):\d+ -> http://(\S+):\d+", orchestrator_log)
    assert moved and moved.group(1) == first_node != moved.group(2), orchestrator_log[-3000:]
    # both jobs' replicas served from the start, each advertised in its own file. Whether the second is back before
    # the last step depends on timing (the first serves by then); a replica's reload is tested in test_replicas.py
    # and test_faults.py.
    assert read_metrics(run, "orchestrator")[0]["inference/replicas_up"] == 2
    assert json.loads((run / "inference_address.1.json").read_text())["job_id"] == jobs["inference-1"]
    _wait_for_states(
        jobs,
        {
            "trainer": ["REQUEUED", "COMPLETED"],
            "orchestrator": ["COMPLETED"],
            "inference": ["NODE_FAIL", "CANCELLED"],
            "inference-1": ["NODE_FAIL", "CANCELLED"],
        },
    )
    record = json.loads((run / "ledger.json").read_text())
    assert MlflowClient(record["tracking_uri"]).get_run(record["run_id"]).info.status == "FINISHED"


@pytest.mark.long
def test_prefill_and_decode_jobs_on_their_own_nodes_serve_a_run(slurm_nodes, cache_dir, tmp_path):
    """`inference.pd.enabled` under launcher=slurm: the prefill job on node3 and the decode job on node2, each placed
    by its own `launcher.sbatch` role; the decode job's router prefills on node3's server, whose KV reaches node2's
    decode server through the run directory (ExampleConnector); new policies reach both nodes; every step trains
    once. With a teacher (on-policy distillation), served by a job of its own on node1 whose address the
    orchestrator is given: every batch carries its KL."""
    from primerl.app import check
    from primerl.model.resolve import prepare_base_model
    from tests.served import save_perturbed

    student = prepare_base_model(check(["+experiment=reverse_text", f"cache_dir={cache_dir}"]).model, cache_dir)
    teacher = save_perturbed(student, tmp_path / "teacher", scale=0.05, seed=3)
    run, steps = tmp_path / "run", 3
    overrides = [
        f"teacher.path={teacher}",
        "+launcher.sbatch.teacher.nodelist=node1",
        "inference.host=0.0.0.0",
        "inference.api_key=test-key",
        "inference.pd.enabled=true",
        "inference.pd.kv_connector=ExampleConnector",
        f"cache_dir={cache_dir}",
        "+launcher.sbatch.prefill.nodelist=node3",
        "+launcher.sbatch.decode.nodelist=node2",
        "+launcher.sbatch.trainer.nodelist=node1",
        "+launcher.sbatch.orchestrator.nodelist=node1",
    ]
    with _driver(run, *overrides, steps=steps) as (driver, out):
        roles = ("prefill", "decode", "teacher")
        jobs = _job_ids(out, roles=roles)
        # all three serve until the run ends (the orchestrator waits for each one's address): a job still pending
        # has no node yet
        _wait(lambda: all(_node_of(jobs[name]) for name in roles) or driver.poll() is not None, 300, out.read_text())
        placed = {name: _node_of(jobs[name]) for name in roles}
        driver.wait(timeout=900)
    text = out.read_text()
    assert driver.returncode == 0, text[-4000:]
    assert placed == {"prefill": "node3", "decode": "node2", "teacher": "node1"}, placed
    assert [r["step"] for r in read_metrics(run, "trainer")] == list(range(steps))
    taught = json.loads((run / "teacher_address.json").read_text())
    assert taught["host"] == "node1" and taught["job_id"] == jobs["teacher"]
    assert f"serving {teacher} at http://0.0.0.0:{taught['port']}" in (run / "logs" / "teacher.log").read_text()
    assert all(r["teacher/kl"] is not None for r in read_metrics(run, "orchestrator"))
    prefill = json.loads((run / "prefill_address.json").read_text())
    assert prefill["host"] == "node3" and prefill["job_id"] == jobs["prefill"]
    decode_log = (run / "logs" / "decode.log").read_text()
    assert f"pair 0: prefill at http://node3:{prefill['port']}, decode at http://0.0.0.0:" in decode_log, decode_log[
        -2000:
    ]
    assert json.loads((run / "inference_address.json").read_text())["host"] == "node2"  # the router, advertised
    (decode_server,) = (run / "logs").glob("vllm-node2-*.log")
    assert decode_server.read_text().count("External Cache Hit") >= 16  # prompts' KV came from node3
    (prefill_server,) = (run / "logs").glob("vllm-node3-*.log")
    assert "kv_producer" in prefill_server.read_text()
    orchestrator_log = (run / "logs" / "orchestrator.log").read_text()
    assert re.search(r"policy v\d -> v3 loaded in flight", orchestrator_log), orchestrator_log[-3000:]
