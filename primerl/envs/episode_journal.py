"""Episode journals: the finished turns of a rollout, on disk, so that a rollout run again (after a crash, or on
another replica) continues from its last finished turn instead of sampling its turns again.

How: a rollout whose runner journals it sends, with each of its generate requests, the sampling key `EPISODE_KEY`
naming its journal file (the dispatcher's `EPISODE` context says which; primerl.envs.verifiers_env.rollout_context).
The HTTP transport of the process that runs the rollout (primerl.envs.http_transport) strips that key before the
request leaves, and then:
- serves the request from the journal when a turn recorded there had the same request body (the same model, sampling
  keys and prompt token ids, so the same conversation up to this turn): no request reaches the server;
- otherwise sends it, and appends the answer (status 200 only) to the journal as one JSON line: the request body's
  digest, the answer's body, and the policy version the server served when it answered (`POLICY_VERSION_HEADER`,
  primerl.inference.served_version; a turn that spanned a weight load has its first tokens from the version before).

Invariants:
- a served turn answers exactly the request it was recorded for, so a resumed episode's conversation is one the policy
  could have produced turn by turn; where the env asks something else (its state did not come back the same), the
  journal stops matching and the episode goes on live from there;
- only envs whose episode is a function of the task and the model's replies (`RESUMES_BY_REPLAY`) are journaled: the
  env runs again from the start and its tools run again, so an env with outside effects (a sandbox it does not
  rebuild, a write to a service) must not declare it;
- a kill mid-append leaves a partial last line, which readers skip: the file format is JSON lines, nothing pickled.
"""

import contextvars
import hashlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from primerl.utils.log import get_logger

log = get_logger(__name__)

EPISODES_DIR = "episodes"  # in the run directory (primerl.orchestrator.episodes)
JOURNAL_NAME = re.compile(r"^task(\d+)-(\d+)\.jsonl$")  # rollout i of the run's k-th task: task<k>-<i>.jsonl
EPISODE_KEY = "primerl_episode"  # the sampling key that carries a rollout's journal path to its transport
RESUMES_BY_REPLAY = "RESUMES_BY_REPLAY"  # the env class attribute that declares it resumable (module docstring)
# The rollout the current task runs for: its journal path. Set by the dispatcher around each rollout; a contextvar
# so that no runner's signature changes, and a task started inside the rollout inherits it.
EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("primerl_episode", default=None)
CACHED_JOURNALS = 1024  # journals a process keeps parsed: at least its rollouts in flight


def resumes_by_replay(env: object) -> bool:
    return bool(getattr(env, RESUMES_BY_REPLAY, False))


@dataclass
class Turn:
    body: bytes  # the server's answer
    version: int | None  # the policy version the server served when it answered; None: not said


def journal_name(task_index: int, sample: int) -> str:
    return f"task{task_index}-{sample}.jsonl"


def strip_episode(body: bytes) -> tuple[bytes, str | None]:
    """(the request body without `EPISODE_KEY`, the journal path it named), or (`body`, None) when it names none. A
    path that is not a journal's (`EPISODES_DIR/JOURNAL_NAME`) is taken out and not written: the key writes files."""
    if EPISODE_KEY.encode() not in body:
        return body, None
    try:
        request = json.loads(body)
        path = Path(request["sampling_params"].pop(EPISODE_KEY))
    except (ValueError, KeyError, TypeError, AttributeError):
        return body, None
    journal = path.parent.name == EPISODES_DIR and JOURNAL_NAME.match(path.name) is not None
    if not journal:
        log.warning("a request named %s as its episode journal, which is none: not journaled", path)
    return json.dumps(request).encode(), str(path) if journal else None


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def read_turns(path: Path) -> dict[str, Turn]:
    """The turns recorded in journal `path` by request digest (none for a missing file; a partial or foreign line is
    skipped)."""
    turns: dict[str, Turn] = {}
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return turns
    for line in lines:
        try:
            entry = json.loads(line)
            turns[entry["request"]] = Turn(entry["body"].encode(), entry.get("version"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return turns


class Journals:
    """The journals of one process's rollouts: which turns each holds (parsed once, re-read when another process
    appended), and appending a new one."""

    def __init__(self) -> None:
        self._parsed: OrderedDict[str, tuple[int, dict[str, Turn]]] = OrderedDict()  # path -> (size read, turns)

    def _turns(self, path: str) -> dict[str, Turn]:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = 0
        cached = self._parsed.get(path)
        if cached is None or cached[0] != size:
            cached = (size, read_turns(Path(path)))
        self._parsed[path] = cached
        self._parsed.move_to_end(path)
        while len(self._parsed) > CACHED_JOURNALS:
            self._parsed.popitem(last=False)
        return cached[1]

    def recorded(self, path: str, request_digest: str) -> Turn | None:
        turn = self._turns(path).get(request_digest)
        if turn is not None:
            log.info("episode %s: a turn served from its journal (sampled by v%s)", Path(path).stem, turn.version)
        return turn

    def record(self, path: str, request_digest: str, turn: Turn) -> None:
        line = json.dumps({"request": request_digest, "body": turn.body.decode(), "version": turn.version}) + "\n"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        turns = self._turns(path)  # as the file is before the append
        with open(path, "a+b") as out:
            if out.seek(0, os.SEEK_END) and (out.seek(-1, os.SEEK_END), out.read(1))[1] != b"\n":
                line = "\n" + line  # the last append was cut by a kill: its part stays a line of its own
            out.write(line.encode())
        turns[request_digest] = turn
        self._parsed[path] = (os.stat(path).st_size, turns)


JOURNALS = Journals()  # this process's
