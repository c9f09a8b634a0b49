"""The orchestrator's components on a fake environment whose rollouts take chosen times (no server): exactly-once
accounting, the two staleness bounds under policy updates in flight, cancellation, batch cuts with leftovers,
async_level=0 exactly on-policy, lock-step mode. Batches go through the real writer into a real run directory."""

import asyncio
import collections
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from primerl.config.orchestrator import FilterConfig, OrchestratorConfig
from primerl.envs.episode_journal import EPISODE
from primerl.envs.types import Rollout, RolloutFailure, ScoredBranch
from primerl.metrics import ORCHESTRATOR, read_metrics
from primerl.orchestrator.dispatcher import Dispatcher, request_seed
from primerl.orchestrator.episodes import EPISODES_DIR, EpisodeJournals
from primerl.orchestrator.loop import Orchestrator
from primerl.orchestrator.sink import Sink
from primerl.orchestrator.source import TaskSource
from primerl.orchestrator.stats import CutMeter
from primerl.orchestrator.types import FinishedGroup, FinishedRollout, Policy
from primerl.orchestrator.writer import BatchWriter
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import rollout_path, samples_path
from primerl.utils.errors import RunError


@dataclass
class FakeTask:
    index: int

    @property
    def key(self) -> str:
        return f"task-{self.index}"


@dataclass
class FakeRunner:
    """Each rollout sleeps `duration(task)` seconds, then returns reward `reward(task, n)` for the runner's n-th
    finished rollout (default task.index % 5 / 4: equal within a group) or fails, per `fails`.
    Records every rollout's start, end and cancellation, and the policy version it started and ended under."""

    policy: Policy
    duration: object = lambda task: 0.001
    fails: object = lambda task: None  # a failure reason, or None
    lost: object = lambda task: False  # whether a failure is its env worker's loss
    reward: object = lambda task, n: (task.index % 5) / 4
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    running: int = 0
    max_running: int = 0
    spans: list = field(default_factory=list)
    seeds: list = field(default_factory=list)  # (task index, seed) of every rollout started
    journals: list = field(default_factory=list)  # (task index, journal name) of every rollout the dispatcher named one

    async def run(self, task: FakeTask, seed: int | None = None):
        self.seeds.append((task.index, seed))
        if (journal := EPISODE.get()) is not None:  # a first turn, finished, as the transport would record it
            self.journals.append((task.index, Path(journal).name))
            Path(journal).parent.mkdir(exist_ok=True)
            with open(journal, "a") as out:
                out.write(json.dumps({"request": str(len(self.seeds)), "body": "{}", "version": self.policy.version}))
                out.write("\n")
        self.started += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        first = self.policy.version
        try:
            await asyncio.sleep(self.duration(task))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        self.finished += 1
        self.spans.append((first, self.policy.version))
        if (reason := self.fails(task)) is not None:
            if reason == "raise":
                raise ValueError("env bug")
            return [RolloutFailure(reason, infrastructure=self.lost(task))]
        ids = [1, 2, 3, 4 + task.index % 7]
        branch = ScoredBranch(ids, [False, False, True, True], [0.0, 0.0, -0.5, -0.7])
        reward = self.reward(task, self.finished)
        return [Rollout(reward, {"score": reward}, [branch], "answer", "user: question", {"turns": 1.0})]


class Killed(Exception):
    """The orchestrator's process is gone: nothing more is written."""


class RecordingWriter(BatchWriter):
    """The real writer (files in the run directory), remembering the samples of each batch. With `kill_after`, the
    first batch from that step on that leaves tasks pending is the last written: a write after it raises `Killed`."""

    def __init__(self, run_dir, kill_after: int | None = None):
        super().__init__(run_dir, seq_len=64, micro_batch_size=4, pad_id=0, temperature=1.0, async_level=1)
        self.samples = {}
        self.kill_after, self.killed = kill_after, False

    def write(self, step, samples, metrics, data_position, examples, tasks=None):
        if self.killed:
            raise Killed(f"killed after the batch of step {step - 1}")
        self.samples[step] = samples
        super().write(step, samples, metrics, data_position, examples, tasks)
        self.killed = self.kill_after is not None and step >= self.kill_after and bool(tasks and tasks.pending)


async def fake_trainer(orchestrator: Orchestrator, run_dir, policy: Policy, train_s: float) -> None:
    """Trains each batch as it appears (train_s seconds), then serves policy step+1, as trainer and watcher do."""
    step = 0
    while True:
        if rollout_path(run_dir, step).exists():
            await asyncio.sleep(train_s)
            policy.version = step + 1
            orchestrator.notify()
            step += 1
        await asyncio.sleep(0.001)


def run_pipeline(
    tmp_path,
    steps: int,
    runner_kwargs=None,
    train_s: float = 0.01,
    sampling_seed=None,
    position=0,
    again=(),
    start_step=0,
    kill_after=None,
    journals=False,
    **cfg_kwargs,
):
    """`kill_after`: stop the orchestrator as a kill would (nothing more written) at the first batch from that step on
    that leaves tasks pending. `journals`: the dispatcher names each rollout's episode journal in the run directory."""
    cfg = OrchestratorConfig(**{"batch_size": 8, "group_size": 4, "max_inflight": 16, **cfg_kwargs})
    policy = Policy()
    runner = FakeRunner(policy, **(runner_kwargs or {}))
    writer = RecordingWriter(tmp_path, kill_after)
    tasks = (FakeTask(i) for i in range(10_000))
    source = TaskSource(tasks, position, again)
    orchestrator = Orchestrator(
        cfg,
        steps,
        source,
        runner,
        writer,
        policy,
        start_step=start_step,
        sampling_seed=sampling_seed,
        journals=EpisodeJournals(tmp_path) if journals else None,
    )

    async def main():
        trainer = asyncio.create_task(fake_trainer(orchestrator, tmp_path, policy, train_s))
        try:
            await asyncio.wait_for(orchestrator.run(), 30)
        except RunError as err:  # the batch writer's failure, as the orchestrator reports it
            if not isinstance(err.__cause__, Killed):
                raise
        finally:
            trainer.cancel()

    asyncio.run(main())
    return orchestrator, runner, writer


def heavy_tail(seed: int):
    rng = random.Random(seed)
    return lambda task: 0.002 * (8 if rng.random() < 0.1 else rng.uniform(0.5, 1.5))


@pytest.mark.parametrize("async_level,max_off", [(1, None), (1, 2), (2, 2)])
def test_staleness_bounds_and_exactly_once_accounting_under_updates_in_flight(tmp_path, async_level, max_off):
    steps = 12
    orch, runner, writer = run_pipeline(
        tmp_path, steps, {"duration": heavy_tail(0)}, async_level=async_level, max_off_policy_steps=max_off
    )
    bound = async_level if max_off is None else max_off
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    assert [r["step"] for r in rows] == list(range(steps))
    for step in range(steps):
        batch = read_rollout_batch(rollout_path(tmp_path, step))
        assert batch.num_samples == 8  # exactly batch_size, leftovers go to the next batch
        assert batch.min_policy_version >= step - bound  # the off-policy bound
        assert rows[step]["policy_version"] >= step - async_level  # cut only once policy step - async_level served
        assert all(step - s.policy_version <= bound for s in writer.samples[step])
        assert rows[step]["off_policy/max"] <= bound
    # every dispatched rollout is accounted for exactly once; every cancelled one really stopped
    c = orch.dispatcher.counts
    assert not orch.dispatcher.groups
    assert c.dispatched == c.ok + c.failed + c.cancelled == runner.started
    assert runner.finished + runner.cancelled == runner.started
    assert c.cancelled >= runner.cancelled  # a cancelled group counts its finished rollouts too
    # updates happened while rollouts were in flight: some rollouts spanned two policies
    assert any(last > first for first, last in runner.spans)
    assert max(r["off_policy/span_max"] for r in rows) >= 1
    positions = [read_rollout_batch(rollout_path(tmp_path, s)).data_position for s in range(steps)]
    assert positions == sorted(positions) and positions[-1] > positions[0]


def test_a_restart_runs_the_tasks_a_stop_left_pending_first_and_every_drawn_task_counts_once(tmp_path):
    """Each batch records the tasks it trained, those that ended untrained since the one before (here: every rollout
    of one task in 6 fails) and those still in flight or buffered at its cut. An orchestrator stopped with groups in
    flight and samples buffered, as a kill leaves it, and started again from its batches runs the pending tasks
    first, with the seeds of their places in the stream; over the whole run every drawn task is trained or spent in
    exactly one batch, or pending at the end."""
    fails = lambda task: "env error" if task.index % 6 == 5 else None  # noqa: E731
    kwargs = {"duration": heavy_tail(1), "fails": fails}
    _, killed, _ = run_pipeline(tmp_path, 12, kwargs, sampling_seed=7, kill_after=3, journals=True)
    start, position, pending = RecordingWriter(tmp_path).resume_point()
    last = read_rollout_batch(rollout_path(tmp_path, start - 1))
    assert 4 <= start < 12 and (position, pending) == (last.data_position, last.tasks_pending) and pending
    # rollout i of task k journals to task<k>-<i>; a journal outlives its task only while the task may run again
    named = collections.defaultdict(set)
    for index, name in killed.journals:
        named[index].add(name)
    assert all(names == {f"task{index}-{i}.jsonl" for i in range(4)} for index, names in named.items())
    assert set(pending) <= {int(p.name[4:].split("-")[0]) for p in (tmp_path / EPISODES_DIR).iterdir()}
    found = EpisodeJournals(tmp_path)
    found.begin(pending, position)  # as the restarted orchestrator does
    order = sorted(pending, key=found.newest_first)  # those with the newest kept turns first
    orchestrator, runner, _ = run_pipeline(
        tmp_path, 12, kwargs, sampling_seed=7, position=position, again=pending, start_step=start, journals=True
    )
    # the pending tasks found their rollouts' finished turns: they continue from them, or run afresh where too stale
    assert orchestrator.journals.resumed_turns + orchestrator.journals.stale_turns >= len(pending)
    final = read_rollout_batch(rollout_path(tmp_path, 11))
    left = {int(p.name[4:].split("-")[0]) for p in (tmp_path / EPISODES_DIR).iterdir()}
    assert all(index in final.tasks_pending or index >= final.data_position for index in left)
    first = [index for index, _ in runner.seeds[: 4 * len(pending)]]
    assert first == [i for i in order for _ in range(4)]  # the pending tasks first, each a whole group
    assert runner.seeds[:4] == [(order[0], request_seed(7, order[0], i)) for i in range(4)]
    batches = [read_rollout_batch(rollout_path(tmp_path, s)) for s in range(12)]
    counted = collections.Counter(i for b in batches for i in b.tasks_trained + b.tasks_spent)
    assert max(counted.values()) == 1
    assert set(counted) | set(batches[-1].tasks_pending) == set(range(batches[-1].data_position))
    assert not set(counted) & set(batches[-1].tasks_pending)
    assert any(b.tasks_spent for b in batches)  # the failing tasks were spent, not lost


def test_stale_groups_are_cancelled_and_counted(tmp_path):
    """One task in 5 is 50x slower: its groups cannot finish before they are too stale, and are cancelled in flight."""
    slow = lambda task: 0.1 if task.index % 5 == 0 else 0.002  # noqa: E731
    orch, runner, writer = run_pipeline(tmp_path, 10, {"duration": slow}, train_s=0.002, max_inflight=32)
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    assert sum(r["rollouts/cancelled"] for r in rows) > 0 and runner.cancelled > 0
    assert all(s.policy_version >= step - 1 for step, batch in writer.samples.items() for s in batch)
    c = orch.dispatcher.counts
    assert c.dispatched == c.ok + c.failed + c.cancelled


def test_async_level_zero_is_exactly_on_policy(tmp_path):
    orch, runner, writer = run_pipeline(tmp_path, 6, {"duration": heavy_tail(1)}, async_level=0)
    for step, samples in writer.samples.items():
        # generated entirely by the policy the batch trains: started and finished under version `step`
        assert {(s.policy_version, s.last_policy_version) for s in samples} == {(step, step)}
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    assert [r["off_policy/max"] for r in rows] == [0] * 6 and [r["off_policy/span_max"] for r in rows] == [0] * 6


def test_each_rollout_samples_with_the_seed_of_its_task_and_place_in_its_group(tmp_path):
    def seeds_by_task(runner) -> dict[int, list]:
        by_task = {}
        for index, seed in runner.seeds:
            by_task.setdefault(index, []).append(seed)
        return by_task

    for name, position in (("first", 0), ("resumed", 40)):  # a resume goes on at its place in the task stream
        (tmp_path / name).mkdir()
        _, runner, _ = run_pipeline(tmp_path / name, 2, sampling_seed=7, position=position)
        by_task = seeds_by_task(runner)
        assert min(by_task) == position and len(by_task) >= 4
        for index, seeds in by_task.items():
            assert sorted(seeds) == sorted(request_seed(7, index, i) for i in range(4)), index
            assert len(set(seeds)) == 4
    assert request_seed(7, 3, 0) != request_seed(8, 3, 0) and 0 <= request_seed(7, 3, 0) < 2**63
    (tmp_path / "unseeded").mkdir()
    _, runner, _ = run_pipeline(tmp_path / "unseeded", 1)
    assert {seed for _, seed in runner.seeds} == {None}


def test_failures_are_counted_and_a_hopeless_env_stops_the_run(tmp_path):
    fails = lambda task: {0: "reward NaN", 1: "raise"}.get(task.index % 4)  # noqa: E731
    orch, runner, writer = run_pipeline(tmp_path / "some", 5, {"fails": fails})
    rows = read_metrics(tmp_path / "some", ORCHESTRATOR)
    c = orch.dispatcher.counts
    assert c.dispatched == c.ok + c.failed + c.cancelled
    # each row counts what finished since the previous cut: two cuts in a row (a buffer that held two batches, on a
    # loaded machine) leave the second with none, so the rows are checked in sum
    assert 0 < sum(r["rollouts/failed"] for r in rows) <= c.failed
    assert 0 < sum(r["rollouts/ok"] for r in rows) <= c.ok
    # the error names the reasons: with no batch cut yet, no step line has logged them
    with pytest.raises(RuntimeError, match=r"rollouts in a row failed .* reasons since the last batch: \d+x .*always"):
        run_pipeline(tmp_path / "all", 5, {"fails": lambda task: "always"})


def test_lost_env_workers_failures_are_counted_but_do_not_stop_the_run(tmp_path):
    """A lost env worker's rollouts (a starved or crashing worker process: its pool bounds its own restarts) are
    counted as failed, but not toward the failed streak that stops a run for a hopeless env: 40 tasks in a row whose
    rollouts are all lost (160, past the bound of 5 x 8 + 2 x 16 = 72) and the run goes on. Env failures between
    them still count: an env that fails every rollout it is given stops the run."""
    lost_first = {"fails": lambda task: "env worker 0 lost" if task.index < 40 else None, "lost": lambda t: True}
    orch, runner, writer = run_pipeline(tmp_path / "lost", 3, lost_first)
    assert orch.dispatcher.counts.failed >= 160 and sorted(writer.samples) == [0, 1, 2]
    assert orch.max_failed_streak == 72
    mixed = {"fails": lambda task: "lost" if task.index % 2 else "always", "lost": lambda task: task.index % 2 == 1}
    with pytest.raises(RuntimeError, match=r"rollouts in a row failed .* \d+x always"):
        run_pipeline(tmp_path / "mixed", 3, mixed)


def test_timeouts_are_failures(tmp_path):
    """Task 0's group hangs; with a loose staleness bound it is not cancelled as stale first, so it times out."""
    slow = lambda task: 5.0 if task.index == 0 else 0.001  # noqa: E731
    orch, runner, writer = run_pipeline(tmp_path, 10, {"duration": slow}, rollout_timeout_s=0.3, async_level=10)
    assert orch.dispatcher.counts.failed == 4  # task 0's group of 4
    assert sum(r["rollouts/failed"] for r in read_metrics(tmp_path, ORCHESTRATOR)) == 4


def test_drain_per_step_is_lock_step(tmp_path):
    orch, runner, writer = run_pipeline(
        tmp_path, 5, {"duration": heavy_tail(2)}, drain_per_step=True, max_inflight=64, async_level=1
    )
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    assert runner.max_running == 8  # one batch of groups at a time, never more
    assert all(r["inflight/rollouts"] == 0 and r["queue/buffered_samples"] == 0 for r in rows)
    assert all(r["rollouts/cancelled"] == 0 for r in rows) and orch.dispatcher.counts.cancelled == 0
    for samples in writer.samples.values():  # each batch is one round: its tasks were drawn together
        assert len({s.task_key for s in samples}) == 2
    assert [r["step"] for r in rows] == list(range(5))
    assert samples_path(tmp_path).read_text().count("\n") >= 5


def test_sink_cuts_exact_batches_keeps_leftovers_and_drops_stale():
    sink = Sink(batch_size=5, max_off_policy_steps=1)

    def group(gid: int, version: int, n: int = 3) -> FinishedGroup:
        branch = ScoredBranch([1, 2], [False, True], [0.0, -1.0])
        rollouts = [FinishedRollout(Rollout(float(i), {}, [branch], "c"), version) for i in range(n)]
        return FinishedGroup(gid, f"t{gid}", version, rollouts, ok_rollouts=n)

    sink.add(group(0, version=0))
    assert sink.cut(step=0) is None  # 3 < 5
    sink.add(group(1, version=1))
    cut = sink.cut(step=1)
    assert len(cut.samples) == 5 and sink.buffered == 1  # one leftover
    assert [s.policy_version for s in cut.samples] == [0, 0, 0, 1, 1]  # oldest first
    assert [s.advantage for s in cut.samples[:3]] == [-1.0, 0.0, 1.0]  # group-relative: reward - group mean
    sink.add(group(2, version=3))
    sink.add(group(3, version=3))
    cut = sink.cut(step=3)  # the v1 leftover lags step 3 by 2 > 1: dropped, and reported with this batch
    assert cut.dropped == 1 and all(s.policy_version == 3 for s in cut.samples) and sink.buffered == 1
    assert [e["task"] for e in cut.examples] == ["t2", "t3"]  # one per group: each task of the batch shows
    assert all(e["policy_versions"] == [3, 3] and e["step"] == 3 for e in cut.examples)


def test_dispatcher_respects_max_inflight_and_cancels_by_version():
    async def main():
        policy = Policy()
        runner = FakeRunner(policy, duration=lambda task: 10.0)
        delivered = []
        dispatcher = Dispatcher(
            TaskSource(FakeTask(i) for i in range(100)),
            runner,
            policy,
            group_size=4,
            max_inflight=10,
            rollout_timeout_s=60,
            deliver=delivered.append,
        )
        running = asyncio.create_task(dispatcher.run())
        await asyncio.sleep(0.05)
        assert dispatcher.inflight_rollouts == 8 and runner.max_running == 8  # two groups of 4 fit under 10
        policy.version = 1
        dispatcher.wake()
        await asyncio.sleep(0.01)
        assert dispatcher.cancel_older_than(1, "test") == 2
        await asyncio.sleep(0.05)  # the two v1 groups that replace them
        assert dispatcher.counts.cancelled == 8 and runner.cancelled == 8
        assert {g.version for g in dispatcher.groups.values()} == {1}
        await dispatcher.stop()
        running.cancel()
        c = dispatcher.counts
        assert c.dispatched == 16 == c.cancelled and not dispatcher.groups
        reasons = [group.reason for group in delivered]
        assert reasons.count("test") == 2 and len(reasons) == 4

    asyncio.run(main())


def test_partial_groups_never_stall_the_cut(tmp_path):
    """Every group loses one rollout, so buffers hold 3, 6, ... samples: a batch of 8 must still fill (admitting only
    when a whole group fits would leave 6 buffered and nothing admitted, forever)."""
    seen: dict[int, int] = {}

    def first_rollout_fails(task):
        seen[task.index] = seen.get(task.index, 0) + 1
        return "first of its group" if seen[task.index] == 1 else None

    orch, runner, writer = run_pipeline(tmp_path, 4, {"fails": first_rollout_fails}, async_level=0)
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    assert [r["step"] for r in rows] == list(range(4)) and all(len(s) == 8 for s in writer.samples.values())
    assert all(r["off_policy/max"] == 0 for r in rows)  # the overshoot was dropped, not trained late


def test_online_evals_run_on_the_served_policy_before_the_next_load(tmp_path):
    from primerl.config.eval import EvalConfig
    from primerl.metrics import EVAL
    from primerl.orchestrator.inference_client import Loaded
    from primerl.orchestrator.online_eval import EvalSuite, OnlineEval
    from primerl.orchestrator.replicas import Replicas
    from primerl.orchestrator.watcher import Watcher
    from primerl.transport.atomic import STABLE_MARKER
    from primerl.transport.run_dir import weights_path

    policy = Policy()
    runner = FakeRunner(policy, duration=lambda task: 0.02)
    cfg = EvalConfig(every=3, num_tasks=5, samples_per_task=2, k=2)

    def online():
        return OnlineEval([EvalSuite("fake", runner, [FakeTask(i) for i in range(5)])], cfg, 7, tmp_path, 5.0)

    class FakeClient:
        base_url = "http://fake"
        loads: list = []

        async def load_weights(self, path, version, group=""):
            self.loads.append((version, runner.finished))  # rollouts finished by the time of the load
            return Loaded(0.001, None)

    evals = online()
    watcher = Watcher(tmp_path, Replicas([FakeClient()]), policy, 0.01, 5.0, before_load=evals.before_load)

    def publish(version):
        weights_path(tmp_path, version).mkdir(parents=True)
        (weights_path(tmp_path, version) / STABLE_MARKER).touch()

    async def main():
        for version in (1, 2, 4, 5, 7):  # the trainer publishes; the watcher skips versions it never saw
            if version == 4:
                publish(3)
            publish(version)
            await watcher.update()
        await evals.finish(policy)

    asyncio.run(main())
    rows = read_metrics(tmp_path, EVAL)
    # v0 at the start, the first version served at or past 3 (v4; v3 was never served), then 6 -> v7 = max_steps
    assert [r["step"] for r in rows] == [0, 4, 7]
    assert all(r["fake/rollouts"] == 10 and r["fake/failures"] == 0 for r in rows)
    assert rows[0]["fake/reward_mean"] == pytest.approx(sum(i % 5 / 4 for i in range(5)) / 5)
    assert "fake/pass_at_2" in rows[0] and "fake/avg_at_2" in rows[0]
    assert all(first == last for first, last in runner.spans)  # no eval rollout saw a load
    # each load came after the eval of the version it replaced: 10 rollouts before v1, 20 before v5 (v4's eval)
    assert FakeClient.loads == [(1, 10), (2, 10), (4, 10), (5, 20), (7, 20)]
    assert not online().due(7) and not online().due(4)  # a resumed orchestrator does not evaluate them again


def test_a_mixture_draws_by_weight_resumes_the_same_stream_and_logs_per_env(tmp_path):
    import itertools

    from primerl.envs.mixture import MixtureRunner, mixed_tasks

    def streams():
        return {"a": (FakeTask(i) for i in range(100_000)), "b": (FakeTask(i) for i in range(3_000))}

    draws = list(itertools.islice(mixed_tasks(streams(), {"a": 0.7, "b": 0.3}, seed=3), 4000))
    share_b = sum(d.env == "b" for d in draws) / len(draws)
    assert abs(share_b - 0.3) < 0.03  # binomial sd ~0.007
    # per env, tasks come in the env's own order, each once; a restart that skips 1000 draws continues the stream
    assert [d.task.index for d in draws if d.env == "a"] == list(range(sum(d.env == "a" for d in draws)))
    resumed = list(itertools.islice(mixed_tasks(streams(), {"a": 0.7, "b": 0.3}, seed=3), 1000, 4000))
    assert [(d.env, d.task.index) for d in resumed] == [(d.env, d.task.index) for d in draws[1000:]]
    assert draws[0].key == f"{draws[0].env}/task-0"
    # the stream ends when the env drawn has run out
    assert len(list(mixed_tasks(streams(), {"a": 0.0001, "b": 1.0}, seed=0))) < 3_100

    # through the orchestrator: each batch logs each env's reward and sample count
    policy = Policy()
    runners = {"a": FakeRunner(policy), "b": FakeRunner(policy, duration=lambda task: 0.003)}
    cfg = OrchestratorConfig(batch_size=8, group_size=4, max_inflight=16)
    writer = RecordingWriter(tmp_path)
    tasks = mixed_tasks(streams(), {"a": 0.5, "b": 0.5}, seed=1)
    orchestrator = Orchestrator(
        cfg, 6, TaskSource(tasks), MixtureRunner(runners), writer, policy, meter=CutMeter(env_names=["a", "b"])
    )

    async def main():
        trainer = asyncio.create_task(fake_trainer(orchestrator, tmp_path, policy, 0.01))
        try:
            await asyncio.wait_for(orchestrator.run(), 30)
        finally:
            trainer.cancel()

    asyncio.run(main())
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    for row, step in zip(rows, range(6)):
        samples = writer.samples[step]
        for env in ("a", "b"):
            mine = [s for s in samples if s.task_key.startswith(f"{env}/")]
            assert row[f"env/{env}/samples"] == len(mine)
            if mine:
                assert row[f"env/{env}/reward_mean"] == pytest.approx(sum(s.reward for s in mine) / len(mine))
    assert sum(r["env/a/samples"] for r in rows) > 0 and sum(r["env/b/samples"] for r in rows) > 0


def test_the_filter_drops_groups_without_signal_and_batches_stay_full(tmp_path):
    """orchestrator.filter.zero_variance with a fake env where only every third task's group has spread rewards:
    no trained sample comes from a group of equal rewards, every batch is full (rejected groups are replaced at
    once by continuous dispatch), the rejected rollouts are counted, and no task is trained twice."""
    steps = 6

    def reward(task, n):
        return float(n % 2) if task.index % 3 == 0 else 1.0

    orch, runner, writer = run_pipeline(
        tmp_path, steps, {"reward": reward}, filter=FilterConfig(zero_variance=True), advantage="grpo"
    )
    rows = read_metrics(tmp_path, ORCHESTRATOR)
    for step in range(steps):
        assert len(writer.samples[step]) == 8
        by_task = collections.defaultdict(list)
        for sample in writer.samples[step]:
            by_task[sample.task_key].append(sample)
        for task, samples in by_task.items():
            assert int(task.split("-")[1]) % 3 == 0, task
            assert sum(s.advantage for s in samples) == pytest.approx(0.0, abs=1e-6)
            assert max(abs(s.advantage) for s in samples) == pytest.approx(1.0, rel=1e-4)  # grpo: unit spread
    filtered = sum(r["rollouts/filtered"] for r in rows)
    assert filtered > 0 and filtered % 4 == 0  # whole groups of group_size 4
    keys = [s.task_key for step in range(steps) for s in writer.samples[step]]
    assert all(count <= 4 for count in collections.Counter(keys).values())  # no task trained twice
    positions = [read_rollout_batch(rollout_path(tmp_path, s)).data_position for s in range(steps)]
    assert positions == sorted(positions)
