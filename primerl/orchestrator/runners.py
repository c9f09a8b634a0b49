"""The rollout runners of an orchestrator: the training env (or the mixture's envs) and the online evals' envs,
each served for the run's lifetime (in process or in env worker processes), with a runner per inference replica
(primerl.orchestrator.replicas)."""

import contextlib
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.envs.types import RolloutRunner
from primerl.orchestrator.sections import OrchestratorSections
from primerl.transport.run_dir import scratch_prefix
from primerl.utils.log import get_logger

if TYPE_CHECKING:
    from primerl.envs.workers import EnvWorkers
    from primerl.orchestrator.online_eval import OnlineEval
    from primerl.orchestrator.replicas import Replicas

log = get_logger("orchestrator")


async def training_envs(
    cfg: OrchestratorSections,
    model_path: str,
    stack: contextlib.AsyncExitStack,
    replicas: "Replicas",
    pools: "list[EnvWorkers]",
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
    cfg: OrchestratorSections,
    model_path: str,
    replicas: "Replicas",
    temperature: float,
    max_tokens: int,
    mixture: bool = False,
) -> RolloutRunner:
    """Rollouts of `envs` (one env, or a mixture's MixedTasks when there are several) spread over `replicas`; an env
    with worker processes (`workers[name]`) runs its rollouts there. An env that resumes by replay keeps its rollouts'
    finished turns in the dispatcher's journals unless `orchestrator.resume_episodes` is off (online evals name no
    journal, so theirs are not kept)."""
    from primerl.envs.episode_journal import resumes_by_replay
    from primerl.envs.mixture import MixtureRunner
    from primerl.envs.verifiers_env import EnvRunner, model_context
    from primerl.envs.workers import WorkerRunner
    from primerl.orchestrator.replicas import ReplicaRunner

    journaled = {name: cfg.orchestrator.resume_episodes and resumes_by_replay(env) for name, env in envs.items()}

    def runner_for(base_url: str) -> RolloutRunner:
        ctx = model_context(
            model_path, cfg.inference, temperature, max_tokens, cfg.orchestrator.sampling_args, base_url
        )
        runners = {
            name: WorkerRunner(workers[name], ctx, journaled[name])
            if name in workers
            else EnvRunner(env, ctx, journaled[name])
            for name, env in envs.items()
        }
        return MixtureRunner(runners) if mixture else next(iter(runners.values()))

    return ReplicaRunner([runner_for(client.base_url) for client in replicas.clients], replicas, runner_for)


async def online_evals(
    cfg: OrchestratorSections,
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
