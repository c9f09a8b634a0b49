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
    """A teacher client: the log-probs it gives each token, after failing `fails` requests; with `serves_at`, only
    once it was moved there."""

    def __init__(self, logprobs: list[float | None], fails: int = 0, serves_at: str | None = None):
        self.logprobs, self.fails, self.requests, self.serves_at = logprobs, fails, 0, serves_at
        self.base_url = "http://teacher"

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        self.requests += 1
        if self.requests <= self.fails or self.serves_at not in (None, self.base_url):
            raise httpx.ConnectError("connection refused")
        return list(self.logprobs)

    def move_to(self, base_url: str) -> None:
        self.base_url = base_url


class OneRollout:
    def __init__(self, rollout: Rollout):
        self.rollout = rollout

    async def run(self, task, seed=None):
        return [self.rollout]


def test_the_teachers_log_probs_become_a_per_token_advantage_beside_the_rewards(monkeypatch):
    monkeypatch.setattr(teacher_module, "TEACHER_BACKOFF_S", 0.01)
    student = [0.0, 0.0, -0.5, -0.7, -0.2]
    teacher = FakeTeacher([None, -3.0, -0.4, -0.9, -0.2], fails=2)  # tried again twice, then it answers
    scoring = TeacherScoring(OneRollout(_rollout(1.0, student)), [teacher])
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
    (failure,) = asyncio.run(TeacherScoring(OneRollout(_rollout(1.0, [0.0] * 5)), [down]).run(task=None))
    assert isinstance(failure, RolloutFailure) and failure.infrastructure and down.requests == 3
    assert "teacher at http://teacher did not score it: connection refused" == failure.reason
    short = FakeTeacher([None, -1.0])  # an answer that does not cover the branch
    (failure,) = asyncio.run(TeacherScoring(OneRollout(_rollout(1.0, [0.0] * 5)), [short]).run(task=None))
    assert isinstance(failure, RolloutFailure) and "2 log-probs for 5 tokens" in failure.reason


def test_under_slurm_the_teacher_is_a_job_of_its_own_whose_address_the_orchestrator_is_given_and_follows(
    cache_dir, tmp_path, monkeypatch
):
    """launcher=slurm with teacher.path: the teacher's job serves the teacher alone on a port of its node and
    advertises it; the orchestrator's job waits for it and is given it; the policy's inference jobs serve no teacher;
    a teacher job requeued to another node is followed at the next retry. Each job's overrides compose with the run's
    into a valid config."""
    from primerl.app import check
    from primerl.entrypoints.inference import teacher_specs
    from primerl.launch.slurm_job import ModuleJob
    from primerl.model.resolve import prepare_base_model
    from primerl.transport.address import advertised_urls_of, write_address

    model = prepare_base_model(check(["+experiment=reverse_text", f"cache_dir={cache_dir}"]).model, cache_dir)
    run = ["+experiment=reverse_text", "launcher=slurm", f"teacher.path={model}", f"output_dir={tmp_path}"]
    run += ["inference.pd.enabled=true", "inference.pd.kv_connector=ExampleConnector"]
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    teacher_job = ModuleJob("teacher", "primerl.entrypoints.inference", [], str(tmp_path), inference_host="0.0.0.0")
    served = check([*run, *teacher_job._address_overrides()])
    assert served.teacher.alone and not served.inference.pd.enabled and served.inference.replicas == 1
    (spec,) = teacher_specs(served, model)  # the teacher alone, on the port it advertised
    assert spec.model == model and advertised_urls_of(tmp_path, "teacher", 1) == [f"http://node3:{spec.port}"]
    assert teacher_specs(check(run), model) == []  # the policy's jobs: no teacher
    two = ModuleJob(
        "teacher", "primerl.entrypoints.inference", [], str(tmp_path / "two"), "0.0.0.0", inference_replicas=2
    )
    pair = teacher_specs(check([*run, "teacher.replicas=2", *two._address_overrides()]), model)
    assert [spec.port for spec in pair] == [pair[0].port, pair[0].port + 1]
    assert advertised_urls_of(tmp_path / "two", "teacher", 2) == [f"http://node3:{s.port}" for s in pair]

    monkeypatch.setenv("SLURM_JOB_ID", "30")
    orchestrator = ModuleJob(
        "orchestrator", "primerl.entrypoints.orchestrator", [], str(tmp_path), teacher_job_id="31", wait_s=5
    )
    given = check([*run, *orchestrator._address_overrides()]).teacher
    assert (given.host, given.port) == ("node3", spec.port)
    stale = ModuleJob(
        "orchestrator", "primerl.entrypoints.orchestrator", [], str(tmp_path), teacher_job_id="9", wait_s=1
    )
    with pytest.raises(RuntimeError, match="no address from teacher job 9"):
        stale._address_overrides()  # an earlier attempt's address is not this job's

    monkeypatch.setattr(teacher_module, "TEACHER_BACKOFF_S", 0.01)
    write_address(tmp_path, 0, "node1", 9400, "31", role="teacher")  # requeued onto node1
    moved = FakeTeacher([None, 0.0, -1.0, -1.0, -1.0], serves_at="http://node1:9400")
    scoring = TeacherScoring(
        OneRollout(_rollout(1.0, [0.0] * 5)), [moved], locate=lambda: advertised_urls_of(tmp_path, "teacher", 1)
    )
    (scored,) = asyncio.run(scoring.run(task=None))
    assert scored.branches[0].teacher_logprobs == [0.0, 0.0, -1.0, -1.0, -1.0] and moved.requests == 2


def test_the_teachers_replicas_share_the_branches_and_a_failed_request_goes_to_another(monkeypatch):
    """teacher.replicas=2: branches in flight at once go to the server with fewer requests in flight; a server that
    is down fails each request once, which is then scored by the other."""
    monkeypatch.setattr(teacher_module, "TEACHER_BACKOFF_S", 0.01)
    logprobs = [None, 0.0, -1.0, -1.0, -1.0]

    class Slow(FakeTeacher):
        async def prompt_logprobs(self, token_ids):
            await asyncio.sleep(0.05)
            return await super().prompt_logprobs(token_ids)

    class Branches:
        async def run(self, task, seed=None):
            return [Rollout(1.0, {}, [ScoredBranch(list(IDS), list(MASK), [0.0] * 5) for _ in range(4)], "c")]

    first, second = Slow(logprobs), Slow(logprobs)
    (scored,) = asyncio.run(TeacherScoring(Branches(), [first, second]).run(task=None))
    assert all(b.teacher_logprobs == [0.0, 0.0, -1.0, -1.0, -1.0] for b in scored.branches)
    assert (first.requests, second.requests) == (2, 2)
    down, up = FakeTeacher(logprobs, fails=10), FakeTeacher(logprobs)
    scoring = TeacherScoring(Branches(), [down, up])
    (scored,) = asyncio.run(scoring.run(task=None))
    assert all(b.teacher_logprobs is not None for b in scored.branches) and up.requests == 4
    assert scoring.in_flight == [0, 0]
