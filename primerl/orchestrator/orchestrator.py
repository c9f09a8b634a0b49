"""The orchestrator: continuous rollouts in, one trainer batch per step out.

    TaskSource -> Dispatcher ==(FinishedGroup | CancelledGroup)==> Sink --(Cut)--> BatchWriter -> rollouts/step_<n>
                      ^  keeps up to max_inflight rollouts in flight     ^ drops samples past max_off_policy_steps
                      |  under the pacing budget below                   |
    Watcher: weights/step_<v> -> pause, load, resume the server -> Policy.version = v -> re-check the cut, wake

Components hold no reference to each other; this module wires them and runs the cut loop (`Orchestrator.run`).

Pacing (`may_admit`). With policy v served, batches up to v + async_level may be cut. The dispatcher may admit a
group while the rollouts in flight plus the samples buffered leave room in the batches still cuttable:
`inflight + buffered < (min(v + async_level + 1, max_steps) - next_step) * batch_size`. So the orchestrator never runs
more than async_level batches (plus less than one group) ahead, and with async_level = 0 a group is admitted only for
the batch of the policy that generates it (an overshoot is dropped at the next cut, counted). Batch n is cut as soon as
`batch_size` fresh-enough samples are buffered and policy n - async_level is served. After each cut, in-flight groups that can no longer be trained (dispatched under a version
older than next_step - max_off_policy_steps) are cancelled. With `drain_per_step` (lock-step, as before continuous
dispatch) one batch of groups is admitted at a time, and it is cut when every one of them has finished.

Online evals (`eval.every`, primerl.orchestrator.online_eval) score the served policy on held-out envs: the watcher
awaits the eval of version v, when one is due, before it loads a newer policy.

Failures are data: a failed rollout is counted; a group whose every rollout failed asks the watcher to check the
server; `max_failed_streak` failed rollouts in a row with no success, the server up, stop the run with the logged
reasons.
"""

import asyncio
import collections
import contextlib
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.config.schema import RunConfig
from primerl.envs.mixture import env_of
from primerl.metrics import OrchestratorMetric as M
from primerl.orchestrator.config import OrchestratorConfig
from primerl.orchestrator.dispatcher import Dispatcher
from primerl.orchestrator.gauges import IdleSampler, LoopLag
from primerl.orchestrator.sink import Cut, Sink
from primerl.orchestrator.source import TaskSource
from primerl.orchestrator.types import CancelledGroup, FinishedGroup, Policy, RolloutRunner
from primerl.orchestrator.writer import BatchWriter
from primerl.utils.errors import RunError, writing
from primerl.utils.log import get_logger

if TYPE_CHECKING:
    from primerl.envs.config import EnvConfig
    from primerl.envs.workers import EnvWorkers
    from primerl.orchestrator.online_eval import OnlineEval
    from primerl.orchestrator.replicas import Replicas

log = get_logger("orchestrator")


class Orchestrator:
    """The cut loop over a dispatcher and a sink. `writer` writes each batch; `policy` is advanced from outside (the
    watcher, or a test), which then calls `notify()`."""

    def __init__(self, cfg: OrchestratorConfig, max_steps: int, source: TaskSource, runner: RolloutRunner,
                 writer: BatchWriter, policy: Policy, start_step: int = 0, serving: Callable[[], bool] = lambda: True,
                 on_failed_group: Callable[[], None] = lambda: None, recoveries: Callable[[], int] = lambda: 0,
                 weight_load_s: Callable[[], float] = lambda: 0.0, idle: IdleSampler | None = None,
                 env_names: list[str] | None = None, replicas: "Replicas | None" = None,
                 env_workers: "Sequence[EnvWorkers]" = ()):  # fmt: skip
        self.cfg, self.max_steps, self.source, self.writer, self.policy = cfg, max_steps, source, writer, policy
        self.step = start_step  # the next batch to cut
        # from the watcher, when wired: is the server up, check it, its recoveries and seconds paused for loads so far
        self.serving, self.on_failed_group, self.recoveries = serving, on_failed_group, recoveries
        self.weight_load_s, self.idle = weight_load_s, idle
        self.env_names = env_names or []  # a mixture's envs: per-env metrics env/<name>/...
        self.replicas = replicas  # when wired: replicas up and rollouts rerouted, per cut
        self._rerouted_at_cut = 0
        self.env_workers = env_workers  # env worker pools (env.workers), training and eval: up and restarted, per cut
        self.sink = Sink(cfg.batch_size, cfg.off_policy_bound)
        self.dispatcher = Dispatcher(source, runner, policy, cfg.group_size, cfg.max_inflight, cfg.rollout_timeout_s,
                                     self._deliver, self.may_admit)  # fmt: skip
        # an environment that fails every rollout for 5 batches' worth stops the run; a server that dies can fail what
        # is in flight and its replacements before the watcher notices (2 x max_inflight), and resets the count
        self.max_failed_streak = 5 * cfg.batch_size + 2 * cfg.max_inflight
        self.loop_lag = LoopLag()
        self._changed = asyncio.Event()
        self._round_start = 0  # drain_per_step: rollouts dispatched before the current round
        self._failed_streak = 0
        self._recoveries_seen = 0
        self._error: Exception | None = None  # found in a delivery callback, raised by the cut loop
        self._failure_reasons: collections.Counter[str] = collections.Counter()
        self._rollout_seconds: list[float] = []  # rollouts finished since the previous cut
        self._counts_at_cut = (0, 0, 0)  # ok, failed, cancelled at the previous cut
        self._last_cut = time.perf_counter()
        self._blocked_since: float | None = None  # when the cut became ready but waited for a newer policy
        self._load_s_at_cut = 0.0

    def notify(self) -> None:
        """Something changed (a group finished, the policy advanced, the server came back): re-check and re-admit."""
        self._changed.set()
        self.dispatcher.wake()

    def may_admit(self, n: int) -> bool:
        if not self.serving():
            return False
        cfg = self.cfg
        cuttable = min(self.policy.version + cfg.async_level + 1, self.max_steps) - self.step
        if cuttable <= 0:
            return False
        committed = self.dispatcher.inflight_rollouts + self.sink.buffered
        if cfg.drain_per_step:
            if committed == 0:
                self._round_start = self.dispatcher.counts.dispatched
            return self.dispatcher.counts.dispatched - self._round_start + n <= cfg.batch_size
        # room for one more sample is enough: failures and drops leave buffers that are not a multiple of a group, and
        # waiting for room for a whole group could wait forever. The overshoot (< group_size) is the next batch's.
        return committed < cuttable * cfg.batch_size

    async def run(self) -> None:
        dispatching = asyncio.create_task(self.dispatcher.run(), name="dispatcher")
        lag = asyncio.create_task(self.loop_lag.run(), name="loop-lag")
        try:
            while self.step < self.max_steps:
                await self._changed.wait()
                self._changed.clear()
                if self._error is not None:
                    raise self._error
                while self.step < self.max_steps and (cut := self._try_cut()) is not None:
                    await self._write(cut)
                self.dispatcher.wake()  # a cut, or a drop of stale samples at a cut that then fell short, frees room
                if dispatching.done() and not self.dispatcher.groups and self.step < self.max_steps:
                    dispatching.result()  # re-raises a dispatcher error
                    if self.sink.buffered < self.cfg.batch_size and self.source.exhausted:
                        raise RunError(f"the task stream ran out at step {self.step} of {self.max_steps}")
        finally:
            lag.cancel()
            await self.dispatcher.stop("the run has all its batches" if self.step >= self.max_steps else "stopping")
            dispatching.cancel()
        ok, failed, cancelled = self._rollout_counts()
        log.info("done: %d batches; rollouts dispatched %d = ok %d + failed %d + cancelled %d", self.step,
                 self.dispatcher.counts.dispatched, ok, failed, cancelled)  # fmt: skip

    def _rollout_counts(self) -> tuple[int, int, int]:
        c = self.dispatcher.counts
        return c.ok, c.failed, c.cancelled

    def _deliver(self, item: FinishedGroup | CancelledGroup) -> None:
        """Called by the dispatcher as each group ends: a finished group goes to the sink at once."""
        self._changed.set()
        if isinstance(item, CancelledGroup):
            log.debug("group %d (policy v%d) cancelled: %s", item.group_id, item.version, item.reason)
            return
        self._failure_reasons.update(item.failures)
        self._rollout_seconds += item.seconds
        if item.ok_rollouts:
            self._failed_streak = 0
            self.sink.add(item)
            return
        self.on_failed_group()
        if not self.serving():
            return  # the server is down: its failures say nothing about the environment
        if self.recoveries() != self._recoveries_seen:
            self._recoveries_seen, self._failed_streak = self.recoveries(), 0
        self._failed_streak += item.failed_rollouts
        if self._failed_streak >= self.max_failed_streak and self._error is None:
            self._error = RunError(f"{self._failed_streak} rollouts in a row failed; the reasons are logged "
                                       "above (environment, reward function or server)")  # fmt: skip

    def _try_cut(self) -> Cut | None:
        cfg = self.cfg
        if cfg.drain_per_step:
            ready = self.dispatcher.inflight_rollouts == 0 and self.sink.buffered > 0
        else:
            ready = self.sink.buffered >= cfg.batch_size
        if not ready:
            return None
        if self.policy.version < self.step - cfg.async_level:
            self._blocked_since = self._blocked_since or time.perf_counter()
            return None
        return self.sink.cut_all(self.step) if cfg.drain_per_step else self.sink.cut(self.step)

    async def _write(self, cut: Cut) -> None:
        now = time.perf_counter()
        stats = self._stats(cut, now)
        self.step += 1  # before the write's await: the dispatcher must never weigh admissions against a stale step
        with writing(f"batch of step {cut.step}", "the trainer never sees a partial batch"):
            await asyncio.to_thread(self.writer.write, cut.step, cut.samples, stats, self.source.position, cut.examples)
        cancelled = self.dispatcher.cancel_older_than(self.step - self.cfg.off_policy_bound,
                                                      f"too stale for step {self.step}")  # fmt: skip
        if cancelled:
            log.info("cancelled %d in-flight group(s) dispatched before policy v%d", cancelled,
                     self.step - self.cfg.off_policy_bound)  # fmt: skip
        for reason, count in self._failure_reasons.most_common(8):
            log.warning("step %d: %d failed rollout trace(s): %s", cut.step, count, reason)
        self._failure_reasons.clear()
        log.info("step %d: reward %.3f, %d samples (policy v%d, off-policy max %d, failed %d, dropped %d), %.1fs",
                 cut.step, stats[M.REWARD_MEAN], len(cut.samples), self.policy.version, stats[M.OFF_POLICY_MAX],
                 stats[M.ROLLOUTS_FAILED], cut.dropped, stats[M.BATCH_S])  # fmt: skip

    def _stats(self, cut: Cut, now: float) -> dict[str, float]:
        samples, rollouts = cut.samples, cut.rollouts
        lags = [cut.step - s.policy_version for s in samples]
        spans = [(s.last_policy_version or s.policy_version) - s.policy_version for s in samples]
        ok, failed, cancelled = self._rollout_counts()
        ok0, failed0, cancelled0 = self._counts_at_cut
        self._counts_at_cut = (ok, failed, cancelled)
        batch_s, self._last_cut = now - self._last_cut, now
        waited, self._blocked_since = (now - self._blocked_since if self._blocked_since else 0.0), None
        load_s = self.weight_load_s()
        loaded, self._load_s_at_cut = load_s - self._load_s_at_cut, load_s
        lag_max, lag_mean = self.loop_lag.take()
        stats = {
            M.REWARD_MEAN: statistics.fmean(s.reward for s in samples),
            M.ROLLOUTS_OK: float(ok - ok0),
            M.ROLLOUTS_FAILED: float(failed - failed0),
            M.ROLLOUTS_CANCELLED: float(cancelled - cancelled0),
            M.OFF_POLICY_MEAN: statistics.fmean(lags),
            M.OFF_POLICY_MAX: float(max(lags)),
            M.OFF_POLICY_DROPPED: float(cut.dropped),
            M.VERSION_SPAN_MAX: float(max(spans)),
            M.POLICY_VERSION: float(self.policy.version),
            M.INFLIGHT: float(self.dispatcher.inflight_rollouts),
            M.BUFFERED: float(self.sink.buffered),
            M.LOOP_LAG_MAX: lag_max,
            M.LOOP_LAG_MEAN: lag_mean,
            M.BATCH_S: batch_s,
            M.WAIT_POLICY_S: waited,
            M.WEIGHT_LOAD_S: loaded,
            M.TOKENS_PER_S: sum(sum(s.sampled_mask) for s in samples) / max(batch_s, 1e-9),
            M.SEQ_LEN_MEAN: statistics.fmean(len(s.token_ids) for s in samples),
        }
        if self._rollout_seconds:
            seconds, self._rollout_seconds = sorted(self._rollout_seconds), []
            stats[M.ROLLOUT_MEDIAN_S] = statistics.median(seconds)
            stats[M.ROLLOUT_P90_S] = seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))]
            stats[M.ROLLOUT_MAX_S] = seconds[-1]
        if self.idle is not None and (idle := self.idle.take()) is not None:
            stats[M.INFERENCE_IDLE] = idle
        if self.replicas is not None:
            stats[M.REPLICAS_UP] = float(self.replicas.up_count)
            stats[M.ROLLOUTS_REROUTED] = float(self.replicas.rerouted - self._rerouted_at_cut)
            self._rerouted_at_cut = self.replicas.rerouted
        if self.env_workers:
            stats[M.ENV_WORKERS_UP] = float(sum(pool.live_count for pool in self.env_workers))
            stats[M.ENV_WORKER_RESTARTS] = float(sum(pool.restarts for pool in self.env_workers))
        reward_fns = sorted({name for r in rollouts for name in r.rewards})
        if len(reward_fns) > 1:  # with one reward function reward/<fn> would repeat reward/mean
            for name in reward_fns:
                stats[f"reward/{name}"] = statistics.fmean(r.rewards[name] for r in rollouts if name in r.rewards)
        for name in self.env_names:
            rewards = [s.reward for s in samples if env_of(s.task_key, [name])]
            stats[f"env/{name}/samples"] = float(len(rewards))
            if rewards:
                stats[f"env/{name}/reward_mean"] = statistics.fmean(rewards)
        for name in sorted({name for r in rollouts for name in r.metrics}):
            stats[f"metric/{name}"] = statistics.fmean(r.metrics[name] for r in rollouts if name in r.metrics)
        return stats


async def serve_envs(entries: "Sequence[EnvConfig]", stack: contextlib.AsyncExitStack,
                     pools: "list[EnvWorkers]") -> tuple[dict, dict]:  # fmt: skip
    """Load each env (its taskset is the task stream) and serve it inside `stack`: in this process, or in its
    `env.workers` worker processes (primerl.envs.workers; each pool is appended to `pools`). Returns the envs and
    the worker pools by name."""
    from primerl.envs.verifiers_env import env_config, load_env
    from primerl.envs.workers import EnvWorkers

    envs, by_name = {}, {}
    for entry in entries:
        env = envs[entry.id] = load_env(entry)
        if entry.workers:
            pool = EnvWorkers(entry.id, env_config(entry), entry.workers, entry.worker_timeout_s,
                              entry.worker_grace_s, task_type=type(env.taskset).task_type())  # fmt: skip
            by_name[entry.id] = await stack.enter_async_context(pool)
            pools.append(by_name[entry.id])
        else:
            await stack.enter_async_context(env.serving())
    return envs, by_name


async def training_envs(cfg: RunConfig, model_path: str, stack: contextlib.AsyncExitStack, replicas: "Replicas",
                        pools: "list[EnvWorkers]") -> tuple[RolloutRunner, Iterable, list[str]]:  # fmt: skip
    """The rollout runner (over the inference `replicas`) and task stream of the training env, or of the `mixture`
    (primerl.envs.mixture) with its env names; every env served inside `stack`."""
    from primerl.envs.mixture import mixed_tasks

    orch = cfg.orchestrator
    envs, workers = await serve_envs(cfg.mixture or [cfg.env], stack, pools)
    streams = {name: env.taskset for name, env in envs.items()}
    runner = replica_runner(envs, workers, cfg, model_path, replicas, orch.temperature, orch.max_tokens,
                            bool(cfg.mixture))  # fmt: skip
    if not cfg.mixture:
        return runner, streams[cfg.env.id], []
    weights = {entry.id: entry.weight for entry in cfg.mixture}
    log.info(
        "training on a mixture: %s", ", ".join(f"{name} {w / sum(weights.values()):.2f}" for name, w in weights.items())
    )
    return runner, mixed_tasks(streams, weights, cfg.seed), list(envs)


def replica_runner(envs: dict, workers: dict, cfg: RunConfig, model_path: str, replicas: "Replicas",
                   temperature: float, max_tokens: int, mixture: bool = False) -> RolloutRunner:  # fmt: skip
    """Rollouts of `envs` (one env, or a mixture's MixedTasks when there are several) spread over `replicas`; an env
    with worker processes (`workers[name]`) runs its rollouts there."""
    from primerl.envs.mixture import MixtureRunner
    from primerl.envs.verifiers_env import EnvRunner, model_context
    from primerl.envs.workers import WorkerRunner
    from primerl.orchestrator.replicas import ReplicaRunner

    def runner_for(base_url: str) -> RolloutRunner:
        ctx = model_context(model_path, cfg.inference, temperature, max_tokens, cfg.orchestrator.sampling_args,
                            base_url)  # fmt: skip
        runners = {name: WorkerRunner(workers[name], ctx) if name in workers else EnvRunner(env, ctx)
                   for name, env in envs.items()}  # fmt: skip
        return MixtureRunner(runners) if mixture else next(iter(runners.values()))

    return ReplicaRunner([runner_for(client.base_url) for client in replicas.clients], replicas, runner_for)


async def online_evals(cfg: RunConfig, model_path: str, run_dir: Path, stack: contextlib.AsyncExitStack,
                       replicas: "Replicas", pools: "list[EnvWorkers]") -> "OnlineEval | None":  # fmt: skip
    """The online evals of `eval.every`, their envs served inside `stack`; None when off or there is nothing to
    evaluate (no `eval.envs` and no held-out split, `env.eval_args`, of the training env)."""
    from primerl.orchestrator.online_eval import EvalSuite, OnlineEval

    e, orch = cfg.eval, cfg.orchestrator
    if not e.every:
        return None
    envs = list(e.envs) or [entry.held_out() for entry in cfg.mixture or [cfg.env] if entry.eval_args]
    if not envs:
        log.warning("eval.every=%d but no eval.envs and no training env has a held-out split (env.eval_args): no "
                    "online evals", e.every)  # fmt: skip
        return None
    suites = []
    for env_cfg in envs:
        served, workers = await serve_envs([env_cfg], stack, pools)
        env = served[env_cfg.id]
        name = env_cfg.id if all(s.name != env_cfg.id for s in suites) else f"{env_cfg.id}#{len(suites) + 1}"
        runner = replica_runner(served, workers, cfg, model_path, replicas, e.temperature,
                                e.max_tokens or orch.max_tokens)  # fmt: skip
        suites.append(EvalSuite(name, runner, list(itertools.islice(iter(env.taskset), e.num_tasks))))
    return OnlineEval(suites, e, cfg.trainer.max_steps, run_dir, orch.rollout_timeout_s)


async def run_orchestrator(cfg: RunConfig) -> None:
    """The real thing: a verifiers env through the train client, a vLLM server, the run directory."""
    from transformers import AutoTokenizer

    from primerl.inference.config import advertised_urls, replica_urls
    from primerl.model.start import initial_model_path
    from primerl.orchestrator.inference_client import InferenceClient
    from primerl.orchestrator.replicas import Replicas
    from primerl.orchestrator.watcher import Watcher
    from primerl.transport.identity import server_identity

    orch, inf = cfg.orchestrator, cfg.inference
    run_dir = Path(cfg.output_dir)
    model_path = initial_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # A cancelled rollout's last request can reach verifiers' interception server after its secret was revoked: a
    # warning per cancelled rollout there says nothing the cancellation count does not.
    logging.getLogger("verifiers.v1.interception.server").setLevel(logging.ERROR)
    writer = BatchWriter(run_dir, cfg.trainer.seq_len, cfg.trainer.micro_batch_size, tokenizer.pad_token_id)
    start, position = writer.resume_point()
    if start:
        log.info("resuming at step %d, task %d", start, position)
    async with contextlib.AsyncExitStack() as stack:
        jobs = cfg.launcher.inference_jobs if cfg.launcher.name == "slurm" else 1
        # SLURM: where the inference jobs said they serve (on several nodes with launcher.inference_jobs > 1)
        advertised = advertised_urls(run_dir, inf, jobs) or []
        urls = [url or default for url, default in itertools.zip_longest(advertised, replica_urls(inf))]
        server_id = server_identity(run_dir)
        clients = [await stack.enter_async_context(InferenceClient(url, inf.api_key, server_id=server_id))
                   for url in urls]  # fmt: skip
        replicas = Replicas(clients)
        pools: list[EnvWorkers] = []  # env worker pools (env.workers), each with a supervisor task
        runner, tasks, env_names = await training_envs(cfg, model_path, stack, replicas, pools)
        online_eval = await online_evals(cfg, model_path, run_dir, stack, replicas, pools)
        await asyncio.gather(*(client.wait_healthy(inf.startup_timeout_s) for client in clients))
        served = {await client.policy_version() for client in clients}
        policy = Policy(min(served))  # replicas that serve another version get the newest at watcher.update()
        watcher = Watcher(run_dir, replicas, policy, orch.weight_poll_s, inf.startup_timeout_s,
                          before_load=online_eval.before_load if online_eval else None,
                          addresses=lambda: advertised_urls(run_dir, inf, jobs))  # fmt: skip
        idle = IdleSampler(replicas.running_requests)
        orchestrator = Orchestrator(orch, cfg.trainer.max_steps, TaskSource(tasks, position),
                                    runner, writer, policy, start, serving=lambda: watcher.serving,
                                    on_failed_group=watcher.check_health, recoveries=lambda: watcher.recoveries,
                                    weight_load_s=lambda: watcher.load_s, idle=idle, env_names=env_names,
                                    replicas=replicas, env_workers=pools)  # fmt: skip
        watcher.on_change = orchestrator.notify
        await watcher.update()  # a restarted orchestrator: the server may serve an older policy than published
        helpers = [asyncio.create_task(watcher.run(), name="watcher"), asyncio.create_task(idle.run(), name="idle")]
        helpers += [pool.supervisor for pool in pools]  # a pool whose workers cannot start ends the run
        main = asyncio.create_task(orchestrator.run(), name="orchestrator")
        try:
            done, _ = await asyncio.wait([main, *helpers], return_when=asyncio.FIRST_COMPLETED)
            if main not in done:  # a helper died: its error is the run's
                main.cancel()
                await asyncio.gather(main, return_exceptions=True)
                for task in done:
                    task.result()
            main.result()
            if online_eval:
                await online_eval.finish(policy)
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
