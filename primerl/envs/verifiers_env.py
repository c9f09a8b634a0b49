"""Load a verifiers v1 environment from the `env` group and turn its episodes into trainable samples.

Errors come back from verifiers as data (`ok=False`, `errors`), not exceptions; a rollout whose trace failed,
timed out, or scored a non-finite reward becomes a counted `RolloutFailure`, never a sample.
"""

import asyncio
import dataclasses
import math
import os
from typing import TYPE_CHECKING

import verifiers.v1 as vf
from verifiers.v1.utils.loaders import load_environment, resolve_env_config

from primerl.config.env import EnvConfig
from primerl.envs.episode_journal import EPISODE, EPISODE_KEY
from primerl.envs.http_transport import API_KEY_VAR, use_aiohttp_for_openai_clients
from primerl.envs.pydantic_memo import memoize_default_factory_check
from primerl.envs.tool_renderer import renderer_config, renderer_name
from primerl.envs.trace_text import final_reply, prompt_text, transcript
from primerl.envs.types import Rollout, RolloutFailure, ScoredBranch
from primerl.utils.errors import ConfigError
from primerl.utils.failpoints import lasting

if TYPE_CHECKING:
    from primerl.config.inference import InferenceConfig

# A dropped connection to the inference server under load is transient: rerun that rollout (twice at most).
# Every other error ends the rollout, which is counted as failed.
SLOW_ENV_S = 2.0  # what each rollout waits while the chaos soak's `env.slow` fault lasts
TRANSIENT_RETRIES = {"rules": [{"type": "ProviderError", "message": "Connection error", "max_retries": 2}]}


def env_config(cfg: EnvConfig) -> dict:
    return {
        "taskset": {"id": cfg.id, **dict(cfg.args)},
        "agent": {
            "runtime": {"type": cfg.runtime},
            "harness": {"id": cfg.harness, **dict(cfg.harness_args)},
            "retries": TRANSIENT_RETRIES,
        },
    }


def load_env(cfg: EnvConfig) -> vf.Env:
    """The verifiers env for `cfg`; an unknown id or bad args is a ConfigError naming the key."""
    memoize_default_factory_check()  # rollouts construct pydantic models with default factories: ~1 ms each without
    use_aiohttp_for_openai_clients()  # httpx's pool costs more CPU than the rest of a rollout at 64 in flight
    try:
        return load_environment(resolve_env_config(env_config(cfg)))
    except ModuleNotFoundError as err:
        raise ConfigError("env.id", f"no installed verifiers environment '{cfg.id}' ({err})") from err
    except (ValueError, TypeError, AttributeError) as err:  # pydantic ValidationError is a ValueError
        first = str(err).splitlines()
        key = "env.harness_args" if any(line.startswith("agent.harness") for line in first) else "env.args"
        raise ConfigError(key, " ".join(line.strip() for line in first[:3])) from err


def _branch(branch) -> ScoredBranch | None:
    """A trainable branch of a trace, or None when its tokens, mask and log-probs do not line up. Its routed experts
    (verifiers' `Branch.routed_experts`, [tokens, layers, k]) come along when the engine returned them for every
    token, else none (the trainer's router then routes it)."""
    ids, mask, logprobs = list(branch.token_ids), list(branch.sampled_mask), list(branch.logprobs or [])
    if not ids or len(mask) != len(ids) or len(logprobs) != len(ids) or not any(mask):
        return None
    routes = branch.routed_experts
    if routes is not None and (routes.ndim != 3 or routes.shape[0] != len(ids)):
        routes = None
    return ScoredBranch(ids, [bool(m) for m in mask], [float(x) for x in logprobs], routed_experts=routes)


def episode_rollouts(episode: vf.Episode) -> list[Rollout | RolloutFailure]:
    """One entry per trainable trace of the episode."""
    traces = [t for t in episode.traces if t.agent.trainable] or [None]
    out: list[Rollout | RolloutFailure] = []
    for trace in traces:
        if trace is None:
            errors = "; ".join(e.message.splitlines()[0] for e in episode.errors) or "no trace"
            out.append(RolloutFailure(f"episode failed: {errors[:300]}"))
            continue
        if not trace.ok or trace.errors:
            first = trace.errors[0].message.splitlines()[0] if trace.errors else trace.stop_condition
            out.append(RolloutFailure(f"trace failed: {str(first)[:300]}"))
            continue
        reward = trace.reward
        if reward is None or not math.isfinite(reward):
            out.append(RolloutFailure(f"non-finite reward {reward!r}"))
            continue
        branches = [b for b in (_branch(br) for br in trace.branches if br.trainable) if b is not None]
        if not branches:
            out.append(RolloutFailure("no trainable tokens (token ids, mask and logprobs missing or misaligned)"))
            continue
        scores = {name: r.score for name, r in trace.rewards.items() if r is not None}
        metrics = {name: float(v) for name, v in trace.metrics.items() if v is not None and math.isfinite(v)}
        out.append(
            Rollout(float(reward), scores, branches, final_reply(trace), prompt_text(trace), metrics, transcript(trace))
        )
    return out


class EnvRunner:
    """One rollout of a verifiers env through `ctx` (its train client records token ids, mask and logprobs):
    the orchestrator's `RolloutRunner`. Errors come back as `RolloutFailure`s. `journaled`: its rollouts keep their
    finished turns in the dispatcher's episode journals (primerl.envs.episode_journal)."""

    def __init__(self, env: vf.Env, ctx: vf.ModelContext, journaled: bool = False):
        self.env, self.ctx, self.journaled = env, ctx, journaled

    async def run(self, task: vf.Task, seed: int | None = None) -> list[Rollout | RolloutFailure]:
        (slot,) = self.env.slots(task, 1)
        return await run_episode(self.env, slot, rollout_context(self.ctx, seed, self.journaled))


async def run_episode(env: vf.Env, slot, ctx: vf.ModelContext, *gate) -> list[Rollout | RolloutFailure]:
    """One slot's episode as rollouts, in the orchestrator or in an env worker (`gate`: the worker's own)."""
    if lasting("env.slow"):  # the chaos soak: an env that answers slowly for a while
        await asyncio.sleep(SLOW_ENV_S)
    return episode_rollouts(await env.run_slot(slot, ctx, *gate))


def rollout_context(ctx: vf.ModelContext, seed: int | None, journaled: bool = False) -> vf.ModelContext:
    """`ctx` for one rollout. Its requests carry `seed`: verifiers' train client passes the sampling keys to vLLM as
    they are, and vLLM samples a seeded request with a generator of its own (the same tokens for the same logits).
    `journaled`, and the dispatcher named the rollout's journal (`EPISODE`): they carry its path too, which the
    transport takes out (primerl.envs.episode_journal)."""
    extra: dict = {} if seed is None else {"seed": seed}
    if journaled and (journal := EPISODE.get()) is not None:
        extra[EPISODE_KEY] = journal
    if not extra:
        return ctx
    return dataclasses.replace(ctx, sampling=ctx.sampling.model_copy(update=extra))


def expose_api_key(inf: "InferenceConfig") -> None:
    """Put the servers' key where verifiers' train client reads it, in this process and so in the env workers it
    starts afterwards: call it before serving envs. Always the config's key: a value inherited from elsewhere (a
    parent that ran another run) must not win."""
    os.environ[API_KEY_VAR] = inf.api_key or "EMPTY"


def model_context(
    model_path: str,
    inf: "InferenceConfig",
    temperature: float,
    max_tokens: int,
    sampling_args: dict | None = None,
    base_url: str | None = None,
) -> vf.ModelContext:
    """How rollouts sample from the inference server at `base_url` (default: the first of `inf`): verifiers' train
    client (token ids, sampled mask, logprobs), tokenizing locally with `model_path`'s tokenizer. It crosses into env
    workers as data (primerl.envs.workers)."""
    from primerl.transport.weights import SERVED_MODEL_NAME

    expose_api_key(inf)
    return vf.ModelContext(
        client=vf.TrainClientConfig(
            base_url=f"{base_url or f'http://{inf.host}:{inf.port}'}/v1",
            api_key_var=API_KEY_VAR,
            renderer_model_name=renderer_name(model_path),
            renderer=renderer_config(model_path),  # tool calls parsed for the tiny model too
        ),
        model=SERVED_MODEL_NAME,
        sampling=vf.SamplingConfig(temperature=temperature, max_tokens=max_tokens, **(sampling_args or {})),
    )


def env_runner(
    env: vf.Env,
    model_path: str,
    inf: "InferenceConfig",
    temperature: float,
    max_tokens: int,
    sampling_args: dict | None = None,
    base_url: str | None = None,
) -> EnvRunner:
    """In-process rollouts of `env` with `model_context(...)`: the evaluator's runner, and the orchestrator's (one per
    replica) when `env.workers=0`."""
    return EnvRunner(env, model_context(model_path, inf, temperature, max_tokens, sampling_args, base_url))
