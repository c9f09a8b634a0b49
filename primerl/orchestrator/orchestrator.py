"""Wiring of the orchestrator process: the envs served (in process or in worker pools), the rollout runners over the
inference replicas, the online evals, the watcher, the writer and the cut loop (primerl.orchestrator.loop), which
holds the components' invariants."""

import asyncio
import contextlib
import gc
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.config.schema import RunConfig
from primerl.envs.types import RolloutRunner
from primerl.orchestrator.gauges import IdleSampler
from primerl.orchestrator.loop import Orchestrator
from primerl.orchestrator.source import TaskSource
from primerl.orchestrator.stats import CutMeter
from primerl.orchestrator.types import Policy
from primerl.orchestrator.writer import BatchWriter
from primerl.transport.run_dir import scratch_prefix
from primerl.utils.log import get_logger

if TYPE_CHECKING:
    from primerl.envs.workers import EnvWorkers
    from primerl.orchestrator.online_eval import OnlineEval
    from primerl.orchestrator.replicas import Replicas
    from primerl.orchestrator.watcher import Watcher

log = get_logger("orchestrator")


async def training_envs(
    cfg: RunConfig, model_path: str, stack: contextlib.AsyncExitStack, replicas: "Replicas", pools: "list[EnvWorkers]"
) -> tuple[RolloutRunner, Iterable, list[str]]:
    """The rollout runner (over the inference `replicas`) and task stream of the training env, or of the `mixture`
    (primerl.envs.mixture) with its env names; every env served inside `stack`."""
    from primerl.envs.mixture import mixed_tasks
    from primerl.envs.serving import serve_envs

    orch = cfg.orchestrator
    envs, workers = await serve_envs(cfg.mixture or [cfg.env], stack, pools, scratch_prefix(cfg.output_dir, "env"))
    streams = {name: env.taskset for name, env in envs.items()}
    runner = replica_runner(
        envs, workers, cfg, model_path, replicas, orch.temperature, orch.max_tokens, bool(cfg.mixture)
    )
    if not cfg.mixture:
        return runner, streams[cfg.env.id], []
    weights = {entry.id: entry.weight for entry in cfg.mixture}
    log.info(
        "training on a mixture: %s", ", ".join(f"{name} {w / sum(weights.values()):.2f}" for name, w in weights.items())
    )
    return runner, mixed_tasks(streams, weights, cfg.seed), list(envs)


def replica_runner(
    envs: dict,
    workers: dict,
    cfg: RunConfig,
    model_path: str,
    replicas: "Replicas",
    temperature: float,
    max_tokens: int,
    mixture: bool = False,
) -> RolloutRunner:
    """Rollouts of `envs` (one env, or a mixture's MixedTasks when there are several) spread over `replicas`; an env
    with worker processes (`workers[name]`) runs its rollouts there."""
    from primerl.envs.mixture import MixtureRunner
    from primerl.envs.verifiers_env import EnvRunner, model_context
    from primerl.envs.workers import WorkerRunner
    from primerl.orchestrator.replicas import ReplicaRunner

    def runner_for(base_url: str) -> RolloutRunner:
        ctx = model_context(
            model_path, cfg.inference, temperature, max_tokens, cfg.orchestrator.sampling_args, base_url
        )
        runners = {
            name: WorkerRunner(workers[name], ctx) if name in workers else EnvRunner(env, ctx)
            for name, env in envs.items()
        }
        return MixtureRunner(runners) if mixture else next(iter(runners.values()))

    return ReplicaRunner([runner_for(client.base_url) for client in replicas.clients], replicas, runner_for)


async def online_evals(
    cfg: RunConfig,
    model_path: str,
    run_dir: Path,
    stack: contextlib.AsyncExitStack,
    replicas: "Replicas",
    pools: "list[EnvWorkers]",
) -> "OnlineEval | None":
    """The online evals of `eval.every`, their envs served inside `stack`; None when off or there is nothing to
    evaluate (no `eval.envs` and no held-out split, `env.eval_args`, of the training env)."""
    from primerl.envs.serving import serve_envs
    from primerl.orchestrator.online_eval import EvalSuite, OnlineEval

    e, orch = cfg.eval, cfg.orchestrator
    if not e.every:
        return None
    envs = list(e.envs) or [entry.held_out() for entry in cfg.mixture or [cfg.env] if entry.eval_args]
    if not envs:
        log.warning(
            "eval.every=%d but no eval.envs and no training env has a held-out split (env.eval_args): no online evals",
            e.every,
        )
        return None
    suites = []
    for env_cfg in envs:
        served, workers = await serve_envs([env_cfg], stack, pools, scratch_prefix(cfg.output_dir, "env"))
        env = served[env_cfg.id]
        name = env_cfg.id if all(s.name != env_cfg.id for s in suites) else f"{env_cfg.id}#{len(suites) + 1}"
        runner = replica_runner(
            served, workers, cfg, model_path, replicas, e.temperature, e.max_tokens or orch.max_tokens
        )
        suites.append(EvalSuite(name, runner, list(itertools.islice(iter(env.taskset), e.num_tasks))))
    return OnlineEval(suites, e, cfg.trainer.max_steps, run_dir, orch.rollout_timeout_s)


async def connect_replicas(cfg: RunConfig, stack: contextlib.AsyncExitStack) -> "Replicas":
    """Clients of the inference replicas, open inside `stack`: at the addresses the SLURM inference jobs advertise
    (on several nodes with launcher.inference_jobs > 1), else at the config's."""
    from primerl.inference.config import replica_urls
    from primerl.orchestrator.inference_client import InferenceClient
    from primerl.orchestrator.replicas import Replicas
    from primerl.transport.address import advertised_urls
    from primerl.transport.identity import server_identity

    inf, run_dir = cfg.inference, Path(cfg.output_dir)
    advertised = advertised_urls(run_dir, inf, inference_jobs(cfg)) or []
    urls = [url or default for url, default in itertools.zip_longest(advertised, replica_urls(inf))]
    server_id = server_identity(run_dir)
    clients = [await stack.enter_async_context(InferenceClient(url, inf.api_key, server_id=server_id)) for url in urls]
    return Replicas(clients)


def inference_jobs(cfg: RunConfig) -> int:
    return cfg.launcher.inference_jobs if cfg.launcher.name == "slurm" else 1


async def run_until_done(
    main: asyncio.Task, helpers: list[asyncio.Task], then: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Await the cut loop `main`, then `then` (the final online eval, which needs the watcher), with the helpers
    running; a helper that ends first (it died) cancels `main`, and its error is the run's."""
    try:
        done, _ = await asyncio.wait([main, *helpers], return_when=asyncio.FIRST_COMPLETED)
        if main not in done:
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
            for task in done:
                task.result()
        main.result()
        if then is not None:
            await then()
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)


def batch_writer(cfg: RunConfig, model_path: str) -> BatchWriter:
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id
    orch, trainer = cfg.orchestrator, cfg.trainer
    return BatchWriter(
        Path(cfg.output_dir), trainer.seq_len, trainer.micro_batch_size, pad_id, orch.temperature, orch.async_level
    )


async def served_policy(replicas: "Replicas", startup_timeout_s: float) -> Policy:
    """Once every replica answers: the oldest version they serve (the others get the newest at watcher.update())."""
    await asyncio.gather(*(client.wait_healthy(startup_timeout_s) for client in replicas.clients))
    return Policy(min({await client.policy_version() for client in replicas.clients}))


def make_watcher(cfg: RunConfig, replicas: "Replicas", policy: Policy, online_eval: "OnlineEval | None") -> "Watcher":
    from primerl.orchestrator.watcher import Watcher
    from primerl.transport.address import advertised_urls

    run_dir, inf = Path(cfg.output_dir), cfg.inference
    before_load = online_eval.before_load if online_eval else None
    addresses = lambda: advertised_urls(run_dir, inf, inference_jobs(cfg))  # noqa: E731 - read again at each recovery
    return Watcher(
        run_dir,
        replicas,
        policy,
        cfg.orchestrator.weight_poll_s,
        inf.startup_timeout_s,
        before_load=before_load,
        addresses=addresses,
        transfer_timeout_s=cfg.weights.timeout_s,
    )


async def run_orchestrator(cfg: RunConfig) -> None:
    """The real thing: verifiers envs, vLLM replicas, the run directory."""
    from primerl.envs.verifiers_env import expose_api_key
    from primerl.model.start import prepare_start_model

    expose_api_key(cfg.inference)  # before any env worker starts: they inherit it
    run_dir, model_path = Path(cfg.output_dir), prepare_start_model(cfg)
    # A cancelled rollout's last request can reach verifiers' interception server after its secret was revoked: a
    # warning per cancelled rollout there says nothing the cancellation count does not.
    logging.getLogger("verifiers.v1.interception.server").setLevel(logging.ERROR)
    writer = batch_writer(cfg, model_path)
    start, position = writer.resume_point()
    if start:
        log.info("resuming at step %d, task %d", start, position)
    async with contextlib.AsyncExitStack() as stack:
        replicas = await connect_replicas(cfg, stack)
        pools: list[EnvWorkers] = []  # env worker pools (env.workers), each with a supervisor task
        runner, tasks, env_names = await training_envs(cfg, model_path, stack, replicas, pools)
        online_eval = await online_evals(cfg, model_path, run_dir, stack, replicas, pools)
        policy = await served_policy(replicas, cfg.inference.startup_timeout_s)
        watcher = make_watcher(cfg, replicas, policy, online_eval)
        idle = IdleSampler(replicas.running_requests)
        meter = CutMeter(env_names, idle, replicas, pools)
        source = TaskSource(tasks, position)
        sampling_seed = cfg.seed if cfg.orchestrator.seed_requests else None
        orchestrator = Orchestrator(
            cfg.orchestrator,
            cfg.trainer.max_steps,
            source,
            runner,
            writer,
            policy,
            start,
            servers=watcher,
            meter=meter,
            sampling_seed=sampling_seed,
        )
        await _run_with_helpers(orchestrator, watcher, idle, pools, online_eval)


async def _run_with_helpers(
    orchestrator: Orchestrator,
    watcher: "Watcher",
    idle: IdleSampler,
    pools: "list[EnvWorkers]",
    online_eval: "OnlineEval | None",
) -> None:
    """Run the orchestrator beside the server watcher, the idle gauge and the env worker pools' supervisors, until it
    is done or one of them fails; then the final online eval."""
    watcher.on_change = orchestrator.notify
    # What start-up built (envs, tokenizer, clients, verifiers' models) lives as long as the run: frozen out of
    # the collector, a full collection no longer walks it on the event loop (against stand-in servers the
    # loop's worst lag fell from ~1 s to ~55 ms; benchmarks/capacity.py)
    gc.freeze()
    await watcher.update()  # a restarted orchestrator: the server may serve an older policy than published
    helpers = [asyncio.create_task(watcher.run(), name="watcher"), asyncio.create_task(idle.run(), name="idle")]
    helpers += [pool.supervisor for pool in pools]  # a pool whose workers cannot start ends the run
    final_eval = (lambda: online_eval.finish(orchestrator.policy)) if online_eval else None
    await run_until_done(asyncio.create_task(orchestrator.run(), name="orchestrator"), helpers, final_eval)
