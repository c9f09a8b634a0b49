"""On-policy distillation, the orchestrator's side: a teacher model scores every token the student sampled.

`TeacherScoring` wraps the run's rollout runner. As each rollout finishes, every trainable branch of it goes to the
teacher's vLLM server (`teacher.path`, started by the inference process) as one prompt-logprob request of its whole
token sequence; the branch then carries `teacher_logprobs`, which the sink turns into a per-token advantage
(primerl.orchestrator.sink). Invariants:
- scoring runs inside the rollout, beside the other rollouts in flight: dispatch never waits on it, and the rollout
  timeout bounds it as it bounds the rest of the rollout;
- each branch goes to the teacher's server with the fewest requests in flight (`teacher.replicas`); a request that
  fails is tried again on the next one (TEACHER_TRIES in all, waiting 1 s, then 2 s); a rollout the teacher could not
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


class TeacherFailed(RuntimeError):
    """A branch the teacher did not score: a request failed TEACHER_TRIES times, or its answer does not fit."""


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
    """A `RolloutRunner`: `runner`'s rollouts, each trainable branch scored by one of the teacher's servers
    (`clients`): the one with the fewest requests in flight, and after a failure the next one. `seconds`: time spent
    waiting for the teacher, summed over rollouts (`take_seconds` reads and resets it). `locate`: where the teacher's
    servers serve now, in the clients' order (None: not known)."""

    def __init__(
        self,
        runner: RolloutRunner,
        clients: list[InferenceClient],
        locate: Callable[[], list[str] | None] = lambda: None,
    ):
        self.runner, self.clients, self.locate = runner, clients, locate
        self.in_flight = [0] * len(clients)
        self.seconds = 0.0

    async def run(self, task: Any, seed: int | None = None) -> list[Rollout | RolloutFailure]:
        entries = await self.runner.run(task, seed)
        branches = [branch for entry in entries if isinstance(entry, Rollout) for branch in entry.branches]
        started = time.perf_counter()
        try:
            scores = await asyncio.gather(*(self._score(branch) for branch in branches))
        except TeacherFailed as err:
            return [RolloutFailure(str(err), infrastructure=True)]
        finally:
            self.seconds += time.perf_counter() - started
        for branch, score in zip(branches, scores, strict=True):
            branch.teacher_logprobs = score
        return entries

    async def _score(self, branch: ScoredBranch) -> list[float]:
        index = min(range(len(self.clients)), key=self.in_flight.__getitem__)
        for attempt in range(TEACHER_TRIES):
            client = self.clients[index]
            self.in_flight[index] += 1
            try:
                scored = await client.prompt_logprobs(branch.token_ids)
                if len(scored) != len(branch.token_ids):
                    raise ValueError(f"{len(scored)} log-probs for {len(branch.token_ids)} tokens")
                return [lp if sampled and lp is not None else 0.0 for lp, sampled in zip(scored, branch.sampled_mask)]
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError, TypeError) as err:
                if attempt == TEACHER_TRIES - 1 or isinstance(err, (KeyError, ValueError, TypeError)):
                    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                    raise TeacherFailed(f"teacher at {client.base_url} did not score it: {first}") from err
            finally:
                self.in_flight[index] -= 1
            await asyncio.sleep(TEACHER_BACKOFF_S * 2**attempt)
            self._follow()
            index = (index + 1) % len(self.clients)
        raise AssertionError("unreachable")

    def _follow(self) -> None:
        urls = self.locate()
        for client, url in zip(self.clients, urls or [], strict=False):
            if url != client.base_url:
                log.warning("the teacher moved: %s -> %s", client.base_url, url)
                client.move_to(url)

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
