"""Wiring of the orchestrator process: the replicas' clients, the rollout runners and online evals
(primerl.orchestrator.runners), the watcher, the writer and the cut loop (primerl.orchestrator.loop), which holds the
components' invariants."""

import asyncio
import contextlib
import gc
import itertools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.orchestrator.admission import KvAdmission
from primerl.orchestrator.episodes import EpisodeJournals
from primerl.orchestrator.gauges import IdleSampler
from primerl.orchestrator.loop import Orchestrator
from primerl.orchestrator.runners import online_evals, training_envs
from primerl.orchestrator.sections import OrchestratorSections
from primerl.orchestrator.source import TaskSource
from primerl.orchestrator.stats import CutMeter
from primerl.orchestrator.types import Policy
from primerl.orchestrator.writer import BatchWriter
from primerl.utils.log import get_logger

if TYPE_CHECKING:
    from primerl.envs.types import RolloutRunner
    from primerl.envs.workers import EnvWorkers
    from primerl.orchestrator.online_eval import OnlineEval
    from primerl.orchestrator.replicas import Replicas
    from primerl.orchestrator.teacher import TeacherScoring
    from primerl.orchestrator.watcher import Watcher

log = get_logger("orchestrator")


async def connect_replicas(cfg: OrchestratorSections, stack: contextlib.AsyncExitStack) -> "Replicas":
    """Clients of the inference replicas, open inside `stack`: at the addresses the SLURM inference jobs advertise
    (on several nodes with launcher.inference_jobs > 1), else at the config's."""
    from primerl.config.inference import replica_urls
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


async def teacher_scoring(
    cfg: OrchestratorSections, stack: contextlib.AsyncExitStack, runner: "RolloutRunner"
) -> "TeacherScoring | None":
    """With `teacher.path`: `runner` with the teacher scoring its rollouts, once the teacher's server answers (the
    inference process starts it beside the replicas, under SLURM the teacher's own job, once it found it shares the
    student's tokenizer: primerl.entrypoints.inference.teacher_specs). Under SLURM it follows the teacher's job to
    the address it advertises when it is requeued."""
    if cfg.teacher.path is None:
        return None
    from primerl.config.teacher import teacher_ports
    from primerl.orchestrator.inference_client import InferenceClient
    from primerl.orchestrator.teacher import TeacherScoring
    from primerl.transport.address import advertised_urls_of
    from primerl.transport.identity import server_identity

    inf, teacher = cfg.inference, cfg.teacher
    urls = [f"http://{teacher.host or inf.host}:{port}" for port in teacher_ports(teacher, inf.port, inf.replicas)]
    server_id = server_identity(Path(cfg.output_dir))
    clients = [InferenceClient(url, inf.api_key, server_id=server_id) for url in urls]
    for client in clients:
        await stack.enter_async_context(client)
        await client.wait_healthy(inf.startup_timeout_s)
    log.info("the teacher at %s scores every rollout (%s)", ", ".join(urls), teacher.path)
    if cfg.launcher.name != "slurm":
        return TeacherScoring(runner, clients)
    return TeacherScoring(runner, clients, locate=lambda: advertised_urls_of(cfg.output_dir, "teacher", len(clients)))


def inference_jobs(cfg: OrchestratorSections) -> int:
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


def batch_writer(cfg: OrchestratorSections, model_path: str) -> BatchWriter:
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id
    orch, trainer = cfg.orchestrator, cfg.trainer
    return BatchWriter(
        Path(cfg.output_dir), trainer.seq_len, trainer.micro_batch_size, pad_id, orch.temperature, orch.async_level
    )


async def served_policy(
    replicas: "Replicas", startup_timeout_s: float, addresses: Callable[[], list[str | None] | None] = lambda: None
) -> Policy:
    """Once every replica answers: the oldest version they serve (the others get the newest at watcher.update()). A
    replica whose inference job is advertised elsewhere meanwhile (requeued under SLURM before it served: its node
    lost) is followed there, as the watcher's recovery follows one later."""

    def follow(index: int) -> None:
        if url := replicas.advertised_elsewhere(index, addresses()):
            replicas.mark_down(index, "its inference job was requeued before it served")
            replicas.move(index, url)
            replicas.mark_up(index)

    waits = (client.wait_healthy(startup_timeout_s, lambda i=i: follow(i)) for i, client in enumerate(replicas.clients))
    await asyncio.gather(*waits)
    return Policy(min({await client.policy_version() for client in replicas.clients}))


def replica_addresses(cfg: OrchestratorSections) -> Callable[[], list[str | None] | None]:
    """The replicas' advertised URLs (primerl.transport.address), read again at each call."""
    from primerl.transport.address import advertised_urls

    run_dir, inf, jobs = Path(cfg.output_dir), cfg.inference, inference_jobs(cfg)
    return lambda: advertised_urls(run_dir, inf, jobs)


def make_watcher(
    cfg: OrchestratorSections, replicas: "Replicas", policy: Policy, online_eval: "OnlineEval | None"
) -> "Watcher":
    from primerl.orchestrator.watcher import Watcher

    run_dir, inf = Path(cfg.output_dir), cfg.inference
    before_load = online_eval.before_load if online_eval else None
    return Watcher(
        run_dir,
        replicas,
        policy,
        cfg.orchestrator.weight_poll_s,
        inf.startup_timeout_s,
        before_load=before_load,
        addresses=replica_addresses(cfg),
        transfer_timeout_s=cfg.weights.timeout_s,
    )


async def run_orchestrator(cfg: OrchestratorSections, model_path: str) -> None:
    """The real thing: verifiers envs, vLLM replicas, the run directory; `model_path` the model the run starts from
    (its tokenizer is the policy's)."""
    from primerl.envs.verifiers_env import expose_api_key

    expose_api_key(cfg.inference)  # before any env worker starts: they inherit it
    run_dir = Path(cfg.output_dir)
    # A cancelled rollout's last request can reach verifiers' interception server after its secret was revoked: a
    # warning per cancelled rollout there says nothing the cancellation count does not.
    logging.getLogger("verifiers.v1.interception.server").setLevel(logging.ERROR)
    writer = batch_writer(cfg, model_path)
    start, position, pending = writer.resume_point()
    if start:
        log.info("resuming at step %d, task %d; %d pending task(s) run again first", start, position, len(pending))
    async with contextlib.AsyncExitStack() as stack:
        replicas = await connect_replicas(cfg, stack)
        pools: list[EnvWorkers] = []  # env worker pools (env.workers), each with a supervisor task
        runner, tasks, env_names = await training_envs(cfg, model_path, stack, replicas, pools)
        teacher = await teacher_scoring(cfg, stack, runner)
        runner = teacher or runner
        online_eval = await online_evals(cfg, model_path, run_dir, stack, replicas, pools)
        policy = await served_policy(replicas, cfg.inference.startup_timeout_s, replica_addresses(cfg))
        watcher = make_watcher(cfg, replicas, policy, online_eval)
        idle = IdleSampler(replicas.running_requests)
        meter = CutMeter(env_names, idle, replicas, pools, teacher)
        source = TaskSource(tasks, position, pending)
        sampling_seed = cfg.seed if cfg.orchestrator.seed_requests else None
        journals = EpisodeJournals(run_dir) if cfg.orchestrator.resume_episodes else None
        admission = None
        if cfg.orchestrator.admission == "kv_pressure":
            admission = KvAdmission(replicas, cfg.orchestrator.max_inflight, cfg.orchestrator.group_size)
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
            admission=admission,
            reward_weight=cfg.teacher.reward_weight,
            distill_coef=cfg.teacher.coef,
            journals=journals,
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
    if orchestrator.admission is not None:
        orchestrator.admission.on_change = orchestrator.notify
        helpers.append(asyncio.create_task(orchestrator.admission.run(), name="admission"))
    helpers += [pool.supervisor for pool in pools]  # a pool whose workers cannot start ends the run
    final_eval = (lambda: online_eval.finish(orchestrator.policy)) if online_eval else None
    await run_until_done(asyncio.create_task(orchestrator.run(), name="orchestrator"), helpers, final_eval)
