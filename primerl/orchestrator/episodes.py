"""Where the run's episode journals live and how long (primerl.envs.episode_journal: what one holds and how a rollout
is resumed from it).

Rollout i of the run's k-th task journals to `<run>/episodes/task<k>-<i>.jsonl`. The task stream is the same in
every incarnation of a run (primerl.orchestrator.source), so a journal names one rollout of one task across restarts:
a pending task run again, or a task drawn after the last batch and drawn again at the same place, finds its
rollouts' finished turns there.

Invariants:
- a journal lives while its task may still run: it is removed once a written batch lists its task as trained or
  spent (`settled`, by name: a task is settled only once all its rollouts ended); an incarnation's `begin` removes
  the journals of tasks neither owed nor at or past its stream position (what a kill left after the write);
- an incarnation looks for kept turns only among the journals it found as it began (`begin`): it draws each task
  once, so whatever else is there is its own rollouts' (only `begin` lists the directory, and each task's journals
  are read at most once);
- a restarted orchestrator runs the pending tasks with the newest kept turns first (they finish first, and the
  first batch is the one their turns are least stale for);
- a task whose journals hold turns older than the batch it would likely land in may train on (the batches the
  samples buffered and in flight fill first, less `orchestrator.max_off_policy_steps`; primerl.orchestrator.pacing) has
  them removed before it runs: it is sampled afresh rather than dropped as too stale once it finishes.
"""

import math
from collections.abc import Iterable
from pathlib import Path

from primerl.envs.episode_journal import EPISODES_DIR, JOURNAL_NAME, Turn, journal_name, read_turns
from primerl.utils.log import get_logger

log = get_logger("orchestrator")


class EpisodeJournals:
    def __init__(self, run_dir: str | Path):
        self.directory = Path(run_dir) / EPISODES_DIR
        self.resumed_turns = 0  # kept turns that tasks drawn again continue from, cumulative
        self.stale_turns = 0  # kept turns removed instead, too stale to train, cumulative
        # the journals an earlier incarnation left, by task: only a task among them can have turns kept when drawn
        # (this incarnation draws each task once), so a draw looks no further
        self._before: dict[int, list[Path]] = {}
        self._read: dict[int, list[Turn]] = {}  # the turns of `_before`'s journals, by task, once read

    def path(self, task_index: int, sample: int) -> Path:
        return self.directory / journal_name(task_index, sample)

    def _files(self) -> list[tuple[int, Path]]:
        try:
            found = sorted(self.directory.iterdir())
        except OSError:  # no journal yet
            return []
        return [(int(match.group(1)), path) for path in found if (match := JOURNAL_NAME.match(path.name))]

    def begin(self, owed: Iterable[int], position: int) -> None:
        """At the start of an incarnation that owes the tasks `owed` and goes on at stream `position`: keep the
        journals that may still be used and remember them; remove the others."""
        keep = set(owed)
        self._before, self._read = {}, {}
        for index, path in self._files():
            if index in keep or index >= position:
                self._before.setdefault(index, []).append(path)
            else:  # settled in a batch written just before a kill, which came before `settled` removed it
                path.unlink(missing_ok=True)

    def _kept(self, task_index: int) -> tuple[list[Path], list[Turn]]:
        files = self._before.get(task_index, [])
        if task_index not in self._read:
            self._read[task_index] = [turn for path in files for turn in read_turns(path).values()]
        return files, self._read[task_index]

    def oldest_version(self, task_index: int) -> int | None:
        """The oldest policy version among the turns kept for the task's rollouts (None: no turn kept; a turn whose
        version the server did not say counts as v0)."""
        _, turns = self._kept(task_index)
        return min((t.version or 0 for t in turns), default=None)

    def newest_first(self, task_index: int) -> float:
        """A sort key of tasks: those with the newest kept turns first, those with none last."""
        oldest = self.oldest_version(task_index)
        return math.inf if oldest is None else -oldest

    def kept_turns(self, task_index: int, oldest_usable: int) -> int | None:
        """`oldest_version`, as the task is about to run. Turns older than `oldest_usable` are removed with their
        journals (logged): the task then runs afresh, and this returns None."""
        files, turns = self._kept(task_index)
        self._before.pop(task_index, None)
        self._read.pop(task_index, None)
        if not turns:
            return None
        oldest = min(t.version or 0 for t in turns)
        if oldest < oldest_usable:
            log.info(
                "task %d: its %d kept turn(s) go back to policy v%d, older than the batch it would land in trains on "
                "(v%d and newer): sampled afresh",
                task_index,
                len(turns),
                oldest,
                oldest_usable,
            )
            for path in files:
                path.unlink(missing_ok=True)
            self.stale_turns += len(turns)
            return None
        self.resumed_turns += len(turns)
        log.info(
            "task %d: %d finished turn(s) kept in %d episode journal(s), sampled by v%s: its rollouts continue from them",
            task_index,
            len(turns),
            len(files),
            "/v".join(str(v) for v in sorted({t.version for t in turns if t.version is not None})) or "?",
        )
        return oldest

    def settled(self, tasks: Iterable[int], group_size: int) -> None:
        """Remove the journals of `tasks`, which a written batch lists as trained or spent (their rollouts all ended)."""
        for index in tasks:
            for sample in range(group_size):
                self.path(index, sample).unlink(missing_ok=True)
