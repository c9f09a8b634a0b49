"""Serving the envs of a run: each env loaded (its taskset is its task stream) and served for the run's lifetime,
in the orchestrator's process or in `env.workers` worker processes (primerl.envs.workers)."""

import contextlib
from collections.abc import Sequence

from primerl.config.env import EnvConfig
from primerl.envs.verifiers_env import env_config, load_env
from primerl.envs.workers import EnvWorkers


async def serve_envs(
    entries: Sequence[EnvConfig],
    stack: contextlib.AsyncExitStack,
    pools: list[EnvWorkers],
    scratch_prefix: str = "primerl-env-",
) -> tuple[dict, dict]:
    """Load each env (its taskset is the task stream) and serve it inside `stack`: in this process, or in its
    `env.workers` worker processes (primerl.envs.workers; each pool is appended to `pools`, its sockets in a temp dir
    named `scratch_prefix...`). Returns the envs and the worker pools by name."""
    envs, by_name = {}, {}
    for entry in entries:
        env = envs[entry.id] = load_env(entry)
        if entry.workers:
            pool = EnvWorkers(
                entry.id,
                env_config(entry),
                entry.workers,
                entry.worker_timeout_s,
                entry.worker_grace_s,
                task_type=type(env.taskset).task_type(),
                scratch_prefix=scratch_prefix,
            )
            by_name[entry.id] = await stack.enter_async_context(pool)
            pools.append(by_name[entry.id])
        else:
            await stack.enter_async_context(env.serving())
    return envs, by_name
