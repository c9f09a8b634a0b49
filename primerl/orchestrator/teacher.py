"""On-policy distillation, the orchestrator's side: a teacher model scores every token the student sampled.

`TeacherScoring` wraps the run's rollout runner. As each rollout finishes, every trainable branch of it goes to the
teacher's vLLM server (`teacher.path`, started by the inference process) as one prompt-logprob request of its whole
token sequence; the branch then carries `teacher_logprobs`, which the sink turns into a per-token advantage
(primerl.orchestrator.sink). Invariants:
- scoring runs inside the rollout, beside the other rollouts in flight: dispatch never waits on it, and the rollout
  timeout bounds it as it bounds the rest of the rollout;
- a request that fails is tried again (TEACHER_TRIES in all, waiting 1 s, then 2 s); a rollout the teacher could not
  score is a `RolloutFailure` marked `infrastructure`, never trained without its scores: the teacher server has its
  own supervisor (the inference process restarts it, and stops the run when it cannot come back), so its failures are
  not counted as the env's;
- the student and the teacher share a tokenizer (`check_same_tokenizer`), or the run does not start;
- under SLURM the teacher's job may be requeued to another node: before each retry `locate` gives the address the
  job advertises now, and the client moves there when it changed.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from primerl.envs.types import Rollout, RolloutFailure, RolloutRunner, ScoredBranch
from primerl.orchestrator.inference_client import InferenceClient
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger

log = get_logger(__name__)

TEACHER_TRIES = 3
TEACHER_BACKOFF_S = 1.0  # the first wait before a request is tried again; doubled each time


def check_same_tokenizer(student: str, teacher: str) -> None:
    """A ConfigError naming `teacher.path` unless both directories' tokenizers map the same text to the same ids
    (the same vocabulary and special tokens): the teacher scores the student's token ids as they are."""
    from transformers import AutoTokenizer

    ours, theirs = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    if ours.get_vocab() != theirs.get_vocab() or ours.all_special_ids != theirs.all_special_ids:
        raise ConfigError(
            "teacher.path",
            f"{teacher} has another tokenizer than the student's ({len(theirs)} tokens against {len(ours)}, or other "
            "ids): the teacher must score the student's token ids as they are",
        )


class TeacherScoring:
    """A `RolloutRunner`: `runner`'s rollouts, each trainable branch scored by the teacher at `client`. `seconds`:
    time spent waiting for the teacher, summed over rollouts (`take_seconds` reads and resets it). `locate`: where the
    teacher serves now (None: not known)."""

    def __init__(self, runner: RolloutRunner, client: InferenceClient, locate: Callable[[], str | None] = lambda: None):
        self.runner, self.client, self.locate = runner, client, locate
        self.seconds = 0.0

    async def run(self, task: Any, seed: int | None = None) -> list[Rollout | RolloutFailure]:
        entries = await self.runner.run(task, seed)
        branches = [branch for entry in entries if isinstance(entry, Rollout) for branch in entry.branches]
        started = time.perf_counter()
        try:
            scores = await asyncio.gather(*(self._score(branch) for branch in branches))
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError, TypeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return [RolloutFailure(f"teacher at {self.client.base_url} did not score it: {first}", infrastructure=True)]
        finally:
            self.seconds += time.perf_counter() - started
        for branch, score in zip(branches, scores, strict=True):
            branch.teacher_logprobs = score
        return entries

    async def _score(self, branch: ScoredBranch) -> list[float]:
        for attempt in range(TEACHER_TRIES):
            try:
                scored = await self.client.prompt_logprobs(branch.token_ids)
                break
            except (httpx.HTTPError, RuntimeError):
                if attempt == TEACHER_TRIES - 1:
                    raise
                await asyncio.sleep(TEACHER_BACKOFF_S * 2**attempt)
                self._follow()
        if len(scored) != len(branch.token_ids):
            raise ValueError(f"{len(scored)} log-probs for {len(branch.token_ids)} tokens")
        return [lp if sampled and lp is not None else 0.0 for lp, sampled in zip(scored, branch.sampled_mask)]

    def _follow(self) -> None:
        url = self.locate()
        if url is not None and url != self.client.base_url:
            log.warning("the teacher moved: %s -> %s", self.client.base_url, url)
            self.client.move_to(url)

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
