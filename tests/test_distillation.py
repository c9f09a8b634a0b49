"""On-policy distillation (primerl.orchestrator.teacher, the sink, the batch): a teacher's log-probs of the sampled
tokens become a per-token advantage `coef x (teacher - student)` beside the reward's (scaled by `reward_weight`),
and the per-step teacher KL; a teacher that fails is tried again, then fails the rollout as infrastructure. The teacher
here is a fake client; tests/test_inference.py scores with a real vLLM server and the e2e suite runs a whole run."""

import asyncio

import httpx
import pytest
import torch

from primerl.envs.types import Rollout, RolloutFailure, ScoredBranch
from primerl.metrics import OrchestratorMetric as M
from primerl.orchestrator import teacher as teacher_module
from primerl.orchestrator.batch import build_batch
from primerl.orchestrator.sink import Sink
from primerl.orchestrator.stats import batch_stats
from primerl.orchestrator.teacher import TeacherScoring
from primerl.orchestrator.types import FinishedGroup, FinishedRollout

IDS, MASK = [1, 2, 3, 4, 5], [False, False, True, True, True]


def _rollout(reward: float, logprobs: list[float]) -> Rollout:
    return Rollout(reward, {"score": reward}, [ScoredBranch(list(IDS), list(MASK), list(logprobs))], "c", "p")


class FakeTeacher:
    """A teacher client: the log-probs it gives each token, after failing `fails` requests."""

    base_url = "http://teacher"

    def __init__(self, logprobs: list[float | None], fails: int = 0):
        self.logprobs, self.fails, self.requests = logprobs, fails, 0

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        self.requests += 1
        if self.requests <= self.fails:
            raise httpx.ConnectError("connection refused")
        return list(self.logprobs)


class OneRollout:
    def __init__(self, rollout: Rollout):
        self.rollout = rollout

    async def run(self, task, seed=None):
        return [self.rollout]


def test_the_teachers_log_probs_become_a_per_token_advantage_beside_the_rewards(monkeypatch):
    monkeypatch.setattr(teacher_module, "TEACHER_BACKOFF_S", 0.01)
    student = [0.0, 0.0, -0.5, -0.7, -0.2]
    teacher = FakeTeacher([None, -3.0, -0.4, -0.9, -0.2], fails=2)  # tried again twice, then it answers
    scoring = TeacherScoring(OneRollout(_rollout(1.0, student)), teacher)
    (scored,) = asyncio.run(scoring.run(task=None))
    # only sampled tokens carry the teacher's log-prob
    assert scored.branches[0].teacher_logprobs == [0.0, 0.0, -0.4, -0.9, -0.2] and teacher.requests == 3
    assert scoring.take_seconds() > 0 and scoring.seconds == 0.0

    other = _rollout(0.0, student)
    other.branches[0].teacher_logprobs = [0.0, 0.0, -0.5, -0.7, -0.2]  # agrees with the student: no KL term
    group = FinishedGroup(0, "t", 0, rollouts=[FinishedRollout(scored, 0), FinishedRollout(other, 0)])
    sink = Sink(2, 1, advantage="mean", reward_weight=0.5, distill_coef=2.0)
    sink.add(group)
    cut = sink.cut(0)
    first, second = cut.samples
    assert first.advantage == pytest.approx(0.25) and second.advantage == pytest.approx(-0.25)  # 0.5 x (r - mean)
    assert first.token_advantages == pytest.approx([0.0, 0.0, 0.2, -0.4, 0.0])  # 2 x (teacher - student)
    assert second.token_advantages == pytest.approx([0.0] * 5)
    batch = build_batch(cut.samples, step=0, seq_len=16, micro_batch_size=2, pad_id=0, temperature=1.0, async_level=1)
    mb = batch.micro_batches[0]
    adv, mask = mb["advantages"][0], mb["loss_mask"][0]
    assert torch.allclose(adv[mask][:3], torch.tensor([0.45, -0.15, 0.25]))  # both terms, token by token
    assert torch.allclose(adv[mask][3:], torch.tensor([-0.25] * 3))
    # the batch's teacher KL: mean over sampled tokens of student - teacher
    expected = ((-0.5 + 0.4) + (-0.7 + 0.9) + 0.0 + 0 + 0 + 0) / 6
    assert batch_stats(cut)[M.TEACHER_KL] == pytest.approx(expected)


def test_without_a_teacher_nothing_changes_and_a_teacher_that_stays_down_fails_the_rollout_as_infrastructure(
    monkeypatch,
):
    sink = Sink(1, 1)
    sink.add(FinishedGroup(0, "t", 0, rollouts=[FinishedRollout(_rollout(1.0, [0.0] * 5), 0)]))
    cut = sink.cut(0)
    assert cut.samples[0].token_advantages is None and M.TEACHER_KL not in batch_stats(cut)

    monkeypatch.setattr(teacher_module, "TEACHER_BACKOFF_S", 0.01)
    down = FakeTeacher([None] * 5, fails=10)
    (failure,) = asyncio.run(TeacherScoring(OneRollout(_rollout(1.0, [0.0] * 5)), down).run(task=None))
    assert isinstance(failure, RolloutFailure) and failure.infrastructure and down.requests == 3
    assert "teacher at http://teacher did not score it: connection refused" == failure.reason
    short = FakeTeacher([None, -1.0])  # an answer that does not cover the branch
    (failure,) = asyncio.run(TeacherScoring(OneRollout(_rollout(1.0, [0.0] * 5)), short).run(task=None))
    assert isinstance(failure, RolloutFailure) and "2 log-probs for 5 tokens" in failure.reason
