"""The MLflow ledger on real stores: embedded sqlite, resume, sweep parent/children, a real `mlflow server`, compare."""

import json
import logging
import os
import subprocess
import sys
import time

import httpx
import pytest
from mlflow.tracking import MlflowClient

from primerl.app import check, compose
from primerl.compare import main as compare_main
from primerl.ledger.follower import MetricsFollower
from primerl.ledger.mlflow_ledger import Ledger, flatten
from primerl.metrics import append_metrics
from primerl.transport.run_dir import ledger_offsets_path
from primerl.utils.errors import RunError
from primerl.utils.process import free_port
from primerl.utils.wait import wait_until
from tests.conftest import run_module, wandb_offline_records


def _cfg(tmp_path, *overrides):
    overrides = (f"ledger.store_dir={tmp_path / 'store'}", *overrides)
    cfg, resolved = check(list(overrides)), compose(list(overrides))
    resolved.output_dir = "."
    return cfg, resolved


def test_flatten_keeps_every_leaf():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": {}}) == {
        "a.b": "1",
        "a.c.d": "x",
        "e": "[1, 2]",
        "f": "{}",
    }


def test_the_summary_section_takes_the_compared_metrics_of_each_process():
    from primerl.ledger.follower import summary

    assert summary("orchestrator", {"reward/mean": 0.5, "rollouts/ok": 64}) == {"reward": 0.5}
    assert summary("trainer", {"loss": 0.1, "mismatch_kl": 2e-4, "entropy": 1.5, "grad_norm": 3.0}) == {
        "loss": 0.1,
        "mismatch_kl": 2e-4,
        "entropy": 1.5,
    }
    row = {"env-a/reward_mean": 0.5, "env-a/tasks": 8, "env-b/reward_mean": 0.75}
    assert summary("eval", row) == {"eval_reward.env-a": 0.5, "eval_reward.env-b": 0.75}


def test_run_record_and_resume_continue_the_same_run(tmp_path):
    cfg, resolved = _cfg(tmp_path, "name=ledger_test", "seed=7")
    run_dir = tmp_path / "run"
    ledger = Ledger.open(cfg, resolved, run_dir)
    client = MlflowClient(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    run = client.get_run(ledger.run_id)
    assert run.data.params["seed"] == "7" and run.data.params["model.arch.hidden_size"] == "128"
    assert run.data.tags["seed"] == "7" and run.data.tags["primerl.kind"] == "train"
    assert client.get_experiment(run.info.experiment_id).name == "ledger_test"
    # MLflow's own fields: Source, Created by, Git commit, Description
    tags = run.data.tags
    assert tags["mlflow.source.name"].startswith("primerl train ") and tags["mlflow.user"]
    assert tags["mlflow.source.git.commit"] == tags["git.commit"] and len(tags["git.commit"]) == 40
    assert tags["mlflow.note.content"].startswith("ledger_test: RL on env primerl-reverse-text")
    resolved_yaml = client.download_artifacts(ledger.run_id, "config/resolved.yaml", str(tmp_path))
    composed_yaml = client.download_artifacts(ledger.run_id, "config/composed.yaml", str(tmp_path))
    assert "${" not in open(resolved_yaml).read() and "${" in open(composed_yaml).read()
    ledger.start_system_metrics(0.2)  # MLflow's monitor, from this process
    time.sleep(1.5)

    append_metrics(run_dir, "trainer", 0, {"loss": 0.5})
    append_metrics(run_dir, "trainer", 1, {"loss": 0.25, "bad": float("nan")})
    MetricsFollower(ledger.run_dir, [ledger]).poll()
    ledger.finish("FAILED")  # e.g. the trainer was killed
    system = client.get_metric_history(ledger.run_id, "system/cpu_utilization_percentage")
    assert system and all(0 <= m.value <= 100 for m in system)
    assert client.get_metric_history(ledger.run_id, "system/system_memory_usage_megabytes")

    resumed = Ledger.open(cfg, resolved, run_dir)
    assert resumed.run_id == ledger.run_id
    assert client.get_run(ledger.run_id).info.status == "RUNNING"
    append_metrics(run_dir, "trainer", 2, {"loss": 0.125})
    MetricsFollower(resumed.run_dir, [resumed]).poll()  # forwards only the new line
    history = client.get_metric_history(ledger.run_id, "trainer/loss")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 0.25), (2, 0.125)]
    # the compared metrics again in the section MLflow shows first, each once across the resume
    summary = client.get_metric_history(ledger.run_id, "Summary/loss")
    assert [(m.step, m.value) for m in summary] == [(0, 0.5), (1, 0.25), (2, 0.125)]
    assert client.get_metric_history(ledger.run_id, "trainer/bad") == []  # NaN is not a metric


def _sample_row(step: int, turns: int) -> dict:
    """A samples.jsonl row as the sink writes it: a multi-turn episode whose first reply called a tool."""
    t0 = 1_700_000_000.0 + step
    messages = [{"role": "system", "content": "Find it.", "end": t0}, {"role": "user", "content": "go", "end": t0}]
    for turn in range(turns):
        start = t0 + 1 + 2 * turn
        reply = {
            "role": "assistant",
            "content": f"answer {turn}",
            "start": start,
            "end": start + 1,
            "finish_reason": "stop",
            "usage": {"input_tokens": 10 + turn, "output_tokens": 3},
        }
        if turn == 0:
            reply |= {"tool_calls": [{"name": "lookup", "arguments": '{"key": "x"}'}], "finish_reason": "tool_calls"}
            messages += [reply, {"role": "tool", "content": "x=3", "end": start + 1.5, "tool_call_id": "c0"}]
        else:
            messages += [reply, {"role": "user", "content": "again", "end": start + 1.5}]
    return {
        "step": step,
        "task": f"t{step}",
        "prompt": "system: Find it.\nuser: go",
        "completion": "answer",
        "reward": 0.5,
        "rewards": {"lcs": 0.25},
        "metrics": {"turns": float(turns)},
        "policy_versions": [step, step + 1],
        "messages": messages,
    }


def test_sampled_rollouts_become_traces_exactly_once(tmp_path):
    cfg, resolved = _cfg(tmp_path, "name=trace_test")
    run_dir = tmp_path / "run"
    ledger = Ledger.open(cfg, resolved, run_dir)
    samples = run_dir / "rollouts" / "samples.jsonl"
    samples.parent.mkdir(parents=True)
    rows = [_sample_row(step, turns) for step, turns in ((0, 3), (1, 1), (2, 2))]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + '{"torn')
    # step 0 only: step 1 is not sampled, the torn line waits
    MetricsFollower(ledger.run_dir, [ledger], sample_every=2).poll()
    with samples.open("r+") as f:  # the writer finishes its line... as a restarted writer would: on a fresh one
        f.seek(0, 2)
        f.write("\n" + json.dumps(rows[2]) + "\n")
    MetricsFollower(ledger.run_dir, [ledger], sample_every=2).poll()  # a resumed driver: step 2 once, step 0 not again
    # a driver killed after the record took the rows but before it saved how far it got sends them again
    ledger_offsets_path(run_dir).unlink()
    MetricsFollower(ledger.run_dir, [ledger], sample_every=2).poll()
    client = ledger.client
    traces = client.search_traces(locations=[ledger.experiment_id], run_id=ledger.run_id, order_by=["timestamp_ms ASC"])
    assert [t.info.tags["primerl.step"] for t in traces] == ["0", "2"]
    spans = {s.name: s for s in traces[0].data.spans}
    root = spans["rollout"]
    assert root.attributes["reward"] == 0.5 and root.attributes["policy_version.last"] == 1
    assert root.attributes["metric.turns"] == 3.0 and root.attributes["task"] == "t0"
    assert root.inputs == {"request": "go\n\nagain\n\nagain"}  # the user turns: the Request column
    assert spans["turn 2"].attributes["mlflow.chat.tokenUsage"] == {
        "input_tokens": 11,
        "output_tokens": 3,
        "total_tokens": 14,
    }
    assert traces[0].info.token_usage["total_tokens"] == 13 + 14 + 15  # the UI's token column
    feedback = {a.name: a.value for a in traces[0].info.assessments}
    assert feedback == {"reward": 0.5, "reward/lcs": 0.25}  # sortable and filterable in the traces table
    assert sorted(spans) == ["rollout", "tool c0", "turn 1", "turn 2", "turn 3"]
    assert spans["turn 1"].span_type == "LLM" and spans["tool c0"].span_type == "TOOL"
    assert spans["turn 1"].outputs["tool_calls"][0]["name"] == "lookup" and spans["tool c0"].outputs["content"] == "x=3"
    assert spans["turn 2"].inputs["messages"] == [{"role": "tool", "content": "x=3"}]
    assert spans["turn 1"].start_time_ns == int(1_700_000_001.0 * 1e9)  # verifiers' recorded times, not now
    assert spans["turn 1"].end_time_ns == int(1_700_000_002.0 * 1e9) <= spans["tool c0"].start_time_ns


def test_sweep_jobs_are_children_of_one_parent(tmp_path):
    sweep = tmp_path / "sweep"
    runs = []
    for job, lr in enumerate(("1e-5", "3e-5")):
        cfg, resolved = _cfg(tmp_path, "name=sweep_test", f"trainer.optim.lr={lr}")
        runs.append(Ledger.open(cfg, resolved, sweep / str(job), sweep_dir=sweep, job_num=job))
    client = runs[0].client
    parents = {client.get_run(r.run_id).data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1
    parent = client.get_run(parents.pop())
    assert parent.data.tags["primerl.kind"] == "sweep"
    assert parent.info.experiment_id == client.get_run(runs[0].run_id).info.experiment_id


def test_a_run_is_named_by_what_tells_it_apart(monkeypatch):
    """The swept key first, then the others in order, by their last key; no paths, ports or secrets; kind and seed."""
    from primerl.ledger.run_info import run_name

    cfg = check(["+experiment=reverse_text", "seed=2"])
    monkeypatch.setattr(sys, "argv", ["primerl.train", "-m", "trainer.optim.lr=1e-4,3e-4", "inference.port=9"])
    overrides = [
        "+experiment=reverse_text",
        "inference.port=9",
        "trainer.max_steps=3",
        "ledger.store_dir=/x",
        "inference.api_key=***",
        "orchestrator.batch_size=16",
        "trainer.optim.lr=3e-4",
        "orchestrator.group_size=4",
        "seed=2",
    ]
    name = run_name(cfg, "train", overrides, "sweep-1")
    assert name == "reverse_text lr=3e-4 max_steps=3 batch_size=16 seed=2 sweep-1"
    assert run_name(cfg, "eval", [], "2026-12-06_10-00-00") == "eval-reverse_text seed=2 2026-12-06_10-00-00"


OPEN_LEDGER = """
from pathlib import Path
from primerl.app import hydra_app, to_run_config
from primerl.ledger.mlflow_ledger import Ledger

@hydra_app()
def main(dict_cfg):
    cfg = to_run_config(dict_cfg)
    Ledger.open(cfg, dict_cfg, Path(cfg.output_dir).resolve()).finish()

main()
"""


def test_a_run_records_its_own_config_dir_and_its_envs_source(tmp_path):
    """Under Hydra, with the user's --config-dir: the record names that directory (what `primerl rerun` passes back)
    and each env's package and source digest; the run is named by its overrides."""
    from primerl.ledger.run_info import env_package

    own = tmp_path / "conf"
    (own / "experiment").mkdir(parents=True)
    (own / "experiment" / "my_exp.yaml").write_text("# @package _global_\ndefaults:\n  - reverse_text\nname: mine\n")
    script = tmp_path / "open_ledger.py"
    script.write_text(OPEN_LEDGER)
    store, run_dir = tmp_path / "store", tmp_path / "run"
    args = ["--config-dir", str(own), "+experiment=my_exp", "trainer.max_steps=3", f"ledger.store_dir={store}"]
    result = subprocess.run(
        [sys.executable, str(script), *args, f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    run = MlflowClient(f"sqlite:///{store / 'mlflow.db'}").get_run(
        json.loads((run_dir / "ledger.json").read_text())["run_id"]
    )
    tags = run.data.tags
    assert tags["primerl.config_dir"] == str(own) and "primerl.config_path" not in tags
    assert tags["env.primerl-reverse-text.source_sha256"] == env_package("primerl-reverse-text")["source_sha256"]
    assert tags["env.primerl-reverse-text.package"].startswith("primerl==")
    assert run.info.run_name.startswith("mine max_steps=3 seed=0 ")


def test_compare_prints_differences_and_plots(tmp_path, capsys):
    sweep, jobs = tmp_path / "sweep", []
    for job, lr in enumerate(("1e-5", "3e-5")):
        key = ["inference.api_key=k"] * job  # a secret set in one run only: masked, and not a setting that differs
        cfg, resolved = _cfg(tmp_path, "name=cmp", f"trainer.optim.lr={lr}", *key)
        ledger = Ledger.open(cfg, resolved, sweep / str(job), sweep_dir=sweep, job_num=job)
        for step in range(3):
            ledger.log_metrics(step, {"reward/mean": 0.1 * step * (job + 1)}, "orchestrator/")
        ledger.finish()
        jobs.append(ledger.run_id)
    original = jobs[0]
    # a rerun of the first job (primerl rerun tags it rerun_of), shortened: `--rerun-of` shows the two side by side
    cfg, resolved = _cfg(tmp_path, "name=cmp", "trainer.optim.lr=1e-5", "trainer.max_steps=2")
    cfg.ledger.tags["rerun_of"] = original
    rerun = Ledger.open(cfg, resolved, tmp_path / "rerun")
    rerun.finish()
    cfg, resolved = _cfg(tmp_path, "name=cmp", "eval.run=/somewhere")  # an eval run: not a training run to compare
    Ledger.open(cfg, resolved, tmp_path / "eval", kind="eval").finish()
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    assert compare_main(["--tracking-uri", uri, "--rerun-of", original, "--plot", ""]) == 0
    shown = capsys.readouterr().out
    assert "2 run(s)" in shown and "settings that differ: trainer.max_steps" in shown, shown
    assert compare_main(["--tracking-uri", uri, "--experiment", "cmp", "--plot", ""]) == 0
    shown = capsys.readouterr().out.splitlines()[0]
    assert "3 run(s)" in shown and "settings that differ: trainer.max_steps, trainer.optim.lr" in shown, shown
    assert compare_main(["--tracking-uri", uri, "--experiment", "cmp", "--kind", "eval", "--plot", ""]) == 0
    assert "1 run(s)" in capsys.readouterr().out
    plot = tmp_path / "cmp.png"
    result = run_module(
        "primerl.compare",
        "--store-dir",
        str(tmp_path / "store"),
        "--experiment",
        "cmp",
        "--sweep",
        str(sweep),
        "--plot",
        str(plot),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "2 run(s)" in result.stdout and "settings that differ: trainer.optim.lr" in result.stdout
    assert "1e-05" in result.stdout and "3e-05" in result.stdout
    assert "0.4" in result.stdout  # the second job's final reward, 0.1 * 2 * 2
    assert plot.stat().st_size > 1000
    missing = run_module("primerl.compare", "--store-dir", str(tmp_path / "nothing"), timeout=120)
    assert missing.returncode == 2 and "no ledger" in missing.stderr


def test_compare_by_seed_gives_each_setting_its_mean_and_range_over_seeds(tmp_path):
    sweep = tmp_path / "sweep"
    evals = {("1e-5", 0): (0.2, 0.6), ("1e-5", 1): (0.4, 0.8), ("3e-5", 0): (0.2, 0.96), ("3e-5", 1): (0.4, 1.0)}
    for job, ((lr, seed), (first, last)) in enumerate(evals.items()):
        cfg, resolved = _cfg(tmp_path, "name=seeds", f"trainer.optim.lr={lr}", f"seed={seed}", "eval.every=10")
        ledger = Ledger.open(cfg, resolved, sweep / str(job), sweep_dir=sweep, job_num=job)
        for step in range(3):
            ledger.log_metrics(step, {"reward/mean": 0.5}, "orchestrator/")
            ledger.log_metrics(step, {"loss": 0.1, "mismatch_kl": (step + 1) * (seed + 1) * 1e-3}, "trainer/")
            time.sleep(0.01)  # the trainer rows span some time: samples per second are finite
        ledger.log_metrics(0, {"primerl-reverse-text/reward_mean": first}, "eval/")
        # the eval due at v10 ran at the first version served past it, v12 in one run: compared as v10
        due = 12 if job == 3 else 10
        ledger.log_metrics(due, {"primerl-reverse-text/reward_mean": last}, "eval/")
        ledger.finish()
    result = run_module(
        "primerl.compare",
        "--store-dir",
        str(tmp_path / "store"),
        "--sweep",
        str(sweep),
        "--by-seed",
        "--markdown",
        "--target",
        "0.95",
        "--mean",
        "trainer/mismatch_kl",
        "--mean",
        "trainer/absent",
        "--plot",
        str(tmp_path / "seeds.png"),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "settings that differ: env.args.seed, seed, trainer.optim.lr" in result.stdout
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ") for line in result.stdout.splitlines() if "e-05" in line
    }
    assert rows.keys() == {"1e-05", "3e-05"}
    header = next(line for line in result.stdout.splitlines() if line.startswith("| trainer.optim.lr"))
    assert header.split(" | ")[1:4] == ["seeds", "eval v0", "eval v10"]
    assert header.split(" | ")[-2:] == ["mean trainer/mismatch_kl", "mean trainer/absent |"]
    # the mean over each run's three steps: seed 0 2e-3, seed 1 4e-3; a metric no run has is '-'
    assert rows["1e-05"][-2:] == ["0.003 [0.002, 0.004]", "- |"]
    assert rows["1e-05"][1:4] == ["2", "0.3 [0.2, 0.4]", "0.7 [0.6, 0.8]"]
    assert rows["3e-05"][3] == "0.98 [0.96, 1]"
    assert rows["1e-05"][-4] == "-" and rows["1e-05"][-3] == "-"  # target never reached
    assert rows["3e-05"][-4] != "-" and rows["3e-05"][-3] == "11 [10, 12]"  # reached at v10 and v12
    assert float(rows["3e-05"][5].split()[0]) > 0  # samples trained per second
    assert (tmp_path / "seeds.png").stat().st_size > 1000


@pytest.mark.slow
def test_real_mlflow_server_on_loopback(tmp_path, caplog):
    """A run waits for a tracking server that is still starting and records to it; one that never answers is one
    line naming it (without the credentials in its URI) after ledger.connect_timeout_s, not MLflow's minutes of
    retries and a traceback."""
    port = free_port()
    cfg, resolved = _cfg(
        tmp_path, f"ledger.tracking_uri=http://user:hunter2@127.0.0.1:{port}", "ledger.connect_timeout_s=2"
    )
    started = time.monotonic()
    with pytest.raises(RunError, match=rf"no tracking server answers at http://127.0.0.1:{port} \(waited 2 s\)"):
        Ledger.open(cfg, resolved, tmp_path / "refused")
    assert time.monotonic() - started < 30 and "hunter2" not in caplog.text
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        cfg, resolved = _cfg(
            tmp_path, "name=server_test", f"ledger.tracking_uri=http://127.0.0.1:{port}", "ledger.connect_timeout_s=120"
        )
        ledger = Ledger.open(cfg, resolved, tmp_path / "run")  # the server is still starting: the run waits for it
        assert f"the tracking server at http://127.0.0.1:{port} does not answer; waiting" in caplog.text
        ledger.log_metrics(0, {"reward/mean": 0.25}, "orchestrator/")
        (tmp_path / "note.txt").write_text("hello")
        ledger.log_artifact(tmp_path / "note.txt")
        samples = tmp_path / "run" / "rollouts" / "samples.jsonl"
        samples.parent.mkdir(parents=True)
        samples.write_text(json.dumps(_sample_row(0, 2)) + "\n")
        MetricsFollower(ledger.run_dir, [ledger], sample_every=1).poll()
        ledger.finish()
        # what the web UI's Traces tab asks the server (MLflow 3.17's JS bundle: POST ajax-api/3.0/mlflow/traces/search)
        found = httpx.post(
            f"http://127.0.0.1:{port}/ajax-api/3.0/mlflow/traces/search",
            timeout=30,
            json={
                "locations": [
                    {"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": ledger.experiment_id}}
                ],
                "max_results": 100,
            },
        )
        assert found.status_code == 200, found.text
        (trace,) = found.json()["traces"]
        tags = {t["key"]: t["value"] for t in trace["tags"]} if isinstance(trace["tags"], list) else trace["tags"]
        assert tags["primerl.step"] == "0" and trace["trace_metadata"]["mlflow.sourceRun"] == ledger.run_id
        client = MlflowClient(f"http://127.0.0.1:{port}")
        run = client.get_run(ledger.run_id)
        assert run.data.metrics["orchestrator/reward/mean"] == 0.25 and run.info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(ledger.run_id)] == ["config", "note.txt"]
        page = f"http://127.0.0.1:{port}/#/experiments/{run.info.experiment_id}/runs/{ledger.run_id}"
        assert ledger.url() == f"{page}?workflowType=machine_learning"
        assert json.loads((tmp_path / "run" / "ledger.json").read_text())["tracking_uri"].startswith("http://")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_mlflow_environment_variables_are_honoured_and_the_config_wins(tmp_path, monkeypatch, caplog):
    """MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME choose the store and experiment when the config does not; a
    ledger.* value set in the config wins over them, and the run says so."""
    caplog.set_level(logging.INFO)
    elsewhere = f"sqlite:///{tmp_path / 'env-store' / 'mlflow.db'}"
    (tmp_path / "env-store").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    cfg, resolved = _cfg(tmp_path, "name=env_test")
    ledger = Ledger.open(cfg, resolved, tmp_path / "run1")
    client = MlflowClient(elsewhere)
    assert ledger.client.tracking_uri == elsewhere
    assert client.get_experiment(client.get_run(ledger.run_id).info.experiment_id).name == "from-env"
    assert not (tmp_path / "store" / "mlflow.db").exists()  # the embedded store was not used
    ledger.finish()
    cfg, resolved = _cfg(tmp_path, "name=env_test", "ledger.experiment_name=from-config")
    ledger = Ledger.open(cfg, resolved, tmp_path / "run2")
    assert client.get_experiment(client.get_run(ledger.run_id).info.experiment_id).name == "from-config"
    assert (
        "ledger.experiment_name=from-config (from the config) overrides MLFLOW_EXPERIMENT_NAME=from-env" in caplog.text
    )
    ledger.finish()


def test_wandb_offline_records_the_same_params_metrics_and_samples_beside_mlflow(tmp_path, monkeypatch):
    """ledger=mlflow_wandb: both trackers get every row once, in W&B's offline mode (no network); a resumed run
    continues the same W&B run."""
    from primerl.ledger.record import record_sft
    from primerl.ledger.wandb_tracker import WandbTracker

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, resolved = _cfg(tmp_path, "name=wandb_test", "ledger=mlflow_wandb", "ledger.wandb.mode=offline")
    run_dir = tmp_path / "run"
    ledger, wandb = Ledger.open(cfg, resolved, run_dir), WandbTracker.open(cfg, resolved, run_dir)
    append_metrics(run_dir, "orchestrator", 0, {"reward/mean": 0.25})
    append_metrics(run_dir, "trainer", 0, {"loss": 0.5})
    append_metrics(run_dir, "trainer", 1, {"loss": 0.125, "grad_norm": float("nan")})
    (run_dir / "rollouts").mkdir()
    sample = {"step": 0, "task": "t0", "prompt": "user: abc", "completion": "cba", "reward": 1.0, "messages": []}
    (run_dir / "rollouts" / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    (tmp_path / "sft.json").write_text(json.dumps({"losses": [2.0, 1.0], "loss_final": 1.0, "train_wall_s": 3.0}))
    MetricsFollower(run_dir, [ledger, wandb]).poll()
    for tracker in (ledger, wandb):
        record_sft(tracker, tmp_path / "sft.json")
    run_id = wandb.run.id
    ledger.finish()
    wandb.finish()
    history, config = wait_until(lambda: wandb_offline_records(run_dir), "W&B's offline record", timeout_s=60)
    trainer = [(row["trainer/step"], row["trainer/loss"]) for row in history if "trainer/loss" in row]
    assert trainer == [(0, 0.5), (1, 0.125)] and not any("trainer/grad_norm" in row for row in history)  # NaN: none
    assert [row["orchestrator/reward/mean"] for row in history if "orchestrator/reward/mean" in row] == [0.25]
    assert [row["Summary/reward"] for row in history if "Summary/reward" in row] == [0.25]
    assert [row["sft/loss"] for row in history if "sft/loss" in row] == [2.0, 1.0]
    (table,) = [row for row in history if "rollouts/samples/_type" in row]  # a table: its fields, flattened
    assert table["rollouts/samples/_type"] == "table-file" and table["rollouts/samples/nrows"] == 1
    assert config["name"] == "wandb_test" and config["trainer.max_steps"] == "20"  # the flattened config, as MLflow's
    assert config["sft.result.loss_final"] == "1"
    history = MlflowClient(ledger.client.tracking_uri).get_metric_history(ledger.run_id, "trainer/loss")
    assert [m.value for m in history] == [0.5, 0.125]  # MLflow got the same rows
    resumed = WandbTracker.open(cfg, resolved, run_dir)
    assert resumed.run.id == run_id
    resumed.finish()


def test_a_torn_samples_line_is_left_out_of_the_record_not_fatal(tmp_path, caplog):
    """A kill mid-append leaves a torn line in rollouts/samples.jsonl: the end-of-run record skips it with a warning,
    keeps the other rows, and names the final policy among the run's logged models once however often it runs."""
    from primerl.ledger.record import record_artifacts
    from primerl.transport.atomic import atomic_dir
    from primerl.transport.run_dir import weights_path

    cfg, resolved = _cfg(tmp_path, "name=torn_test", "ledger.log_model=false")  # a reference: no files to save
    run_dir = tmp_path / "run"
    ledger = Ledger.open(cfg, resolved, run_dir)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("[]\n")
    (run_dir / "rollouts").mkdir()
    good = {"step": 0, "task": "t0", "prompt": "p", "completion": "c", "reward": 1.0}
    (run_dir / "rollouts" / "samples.jsonl").write_text(json.dumps(good) + '\n{"step": 1, "tas\n')
    with atomic_dir(weights_path(run_dir, 2)) as staging:
        (staging / "config.json").write_text("{}")
    record_artifacts(ledger, cfg.ledger, cfg.model, run_dir)
    record_artifacts(ledger, cfg.ledger, cfg.model, run_dir)  # a resumed driver records again
    assert "line 2 is not a sample row; left out of the record" in caplog.text
    assert [a.path for a in ledger.client.list_artifacts(ledger.run_id, "samples")] == ["samples/step_000000.json"]
    models = ledger.client.search_logged_models([ledger.experiment_id], f"source_run_id = '{ledger.run_id}'")
    assert [(m.name, m.tags["primerl.policy_version"]) for m in models] == [("policy-v2", "2")]
    ledger.finish()


def test_the_final_policy_is_a_logged_model_that_mlflow_loads_with_its_eval_scores(tmp_path, monkeypatch):
    """The final policy's logged model holds the weights in MLflow's transformers flavor: `mlflow.transformers
    .load_model` gives a pipeline that generates what transformers generates from the published directory. It is the
    run's output, carries the online eval of its version, and is logged once; past `ledger.log_model_max_mb` it
    keeps no files."""
    import mlflow
    import mlflow.transformers
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primerl.ledger.logged_model import record_policy
    from primerl.model.tiny import build_tiny_model

    cfg, resolved = _cfg(tmp_path, "name=model_test")
    run_dir = tmp_path / "run"
    ledger = Ledger.open(cfg, resolved, run_dir)
    policy = build_tiny_model(str(tmp_path / "cache"), cfg.model.arch, 0)
    append_metrics(run_dir, "eval", 3, {"primerl-reverse-text/reward_mean": 0.5, "primerl-reverse-text/tasks": 8})
    model_id = record_policy(ledger, cfg.ledger, cfg.model, run_dir, policy, 3)
    assert record_policy(ledger, cfg.ledger, cfg.model, run_dir, policy, 3) is None  # a resumed driver records it once
    model = ledger.client.get_logged_model(model_id)
    assert model.name == "policy-v3" and model.source_run_id == ledger.run_id
    assert {m.key: m.value for m in model.metrics} == {
        "eval/primerl-reverse-text/reward_mean": 0.5,
        "eval/primerl-reverse-text/tasks": 8,
    }
    assert [o.model_id for o in ledger.client.get_run(ledger.run_id).outputs.model_outputs] == [model_id]

    # MLflow's loader reads the process-wide tracking URI, which it also exports to the environment: both are put
    # back afterwards, so later tests' ledgers use their own stores
    monkeypatch.setenv("MLFLOW_TRACKING_URI", ledger.client.tracking_uri)
    mlflow.set_tracking_uri(ledger.client.tracking_uri)
    try:
        pipeline = mlflow.transformers.load_model(f"models:/{model_id}")
    finally:
        mlflow.set_tracking_uri(None)
    prompt = "abcdef"
    shown = pipeline(prompt, max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    tokenizer, reference = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = reference.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert shown == tokenizer.decode(greedy, skip_special_tokens=True)

    cfg.ledger.log_model_max_mb = 0  # larger than the limit: a record of where the weights are, no copy
    big = ledger.client.get_logged_model(record_policy(ledger, cfg.ledger, cfg.model, run_dir, policy, 4))
    assert big.tags["primerl.weights_dir"] == str(policy) and big.params["files_in_store"] == "False"
    assert ledger.client.list_logged_model_artifacts(big.model_id) == []
    # a driver killed while logging leaves its model PENDING: the resumed driver logs that version again
    pending = ledger.client.create_logged_model(ledger.experiment_id, "policy-v5", ledger.run_id)
    again = record_policy(ledger, cfg.ledger, cfg.model, run_dir, policy, 5)
    assert again not in (None, pending.model_id) and ledger.logged_model("policy-v5") == again
    ledger.finish()


def test_bookkeeping_never_stops_the_run_and_catches_up(tmp_path, caplog):
    """A store locked past MLflow's wait: the follower's poll fails, is logged, and loses nothing; once the store is
    free again every row reaches the record exactly once."""
    import sqlite3

    from primerl.ledger.follower import FollowerThread

    cfg, resolved = _cfg(tmp_path, "name=locked_test")
    run_dir = tmp_path / "run"
    ledger = Ledger.open(cfg, resolved, run_dir)
    recorder = FollowerThread(MetricsFollower(run_dir, [ledger]), every_s=3600)
    append_metrics(run_dir, "trainer", 0, {"loss": 0.5})
    assert recorder.poll_once()
    append_metrics(run_dir, "trainer", 1, {"loss": 0.25})
    append_metrics(run_dir, "trainer", 2, {"loss": 0.125})
    lock = sqlite3.connect(tmp_path / "store" / "mlflow.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another writer holds the store (sweep jobs share one)
    try:
        assert not recorder.poll_once()
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert "the run's record cannot take new rows now" in caplog.text
    assert recorder.close()  # the last poll of the run: it catches up
    history = ledger.client.get_metric_history(ledger.run_id, "trainer/loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 0.25), (2, 0.125)]
    ledger.finish()


def test_the_inference_key_reaches_no_record_and_no_child_command_line(tmp_path, monkeypatch):
    """A key given on the command line: MLflow params, tags and config artifacts show it masked, the run's .hydra
    files too, and the children's overrides do not hold it (they read it from PRIMERL_API_KEY)."""
    from primerl.launch.driver import keep_secrets_out
    from primerl.utils.secrets import API_KEY_ENV

    key = "s3cret-key-1234"
    monkeypatch.setenv(API_KEY_ENV, "")  # recorded, so the key the driver sets below is gone after the test
    monkeypatch.delenv(API_KEY_ENV)
    monkeypatch.setattr(sys, "argv", ["primerl.train", "+experiment=reverse_text", f"inference.api_key={key}"])
    cfg, resolved = _cfg(tmp_path, "name=secret_test", f"inference.api_key={key}")
    ledger = Ledger.open(cfg, resolved, tmp_path / "run")
    run = ledger.client.get_run(ledger.run_id)
    assert run.data.params["inference.api_key"] == "***" and key not in run.data.tags["mlflow.source.name"]
    for name in ("resolved", "composed"):
        text = open(ledger.client.download_artifacts(ledger.run_id, f"config/{name}.yaml", str(tmp_path))).read()
        assert key not in text and "api_key: ***" in text
    ledger.finish()
    hydra = tmp_path / "out" / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text(f"- seed=1\n- inference.api_key={key}\n")
    cfg.output_dir = str(tmp_path / "out")
    children = keep_secrets_out(["seed=1", f"inference.api_key={key}"], cfg)
    assert children == ["seed=1"] and os.environ[API_KEY_ENV] == key
    assert key not in (hydra / "overrides.yaml").read_text()
    assert check([]).inference.api_key == key  # what a child's config resolves to

    # quoted on the command line: the servers get the key itself, and config.yaml (unquoted there) shows it masked
    quoted = f"inference.api_key='{key}'"
    cfg, _ = _cfg(tmp_path, "name=secret_test", quoted)
    cfg.output_dir = str(tmp_path / "out")
    (hydra / "overrides.yaml").write_text(f"- {quoted}\n")
    (hydra / "config.yaml").write_text(f"inference:\n  api_key: {key}\n")
    assert keep_secrets_out([quoted], cfg) == [] and os.environ[API_KEY_ENV] == key
    assert key not in (hydra / "overrides.yaml").read_text() + (hydra / "config.yaml").read_text()
