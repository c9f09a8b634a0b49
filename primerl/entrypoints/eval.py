"""`primerl eval`: score a model, or a run's published policy, on any verifiers environment.

The same rollout path as training: a vLLM server (the `inference` group) serving the model, the env's own harness
and reward functions, verifiers' train client. Every task of the first `eval.num_tasks` of the env's stream gets
`eval.samples_per_task` rollouts at `eval.temperature`.

    primerl eval +experiment=reverse_text eval.model=~/.cache/primerl/sft/reverse_text-XXXX
    primerl eval +experiment=reverse_text eval.run=outputs/reverse_text/RUN eval.step=60
    primerl eval env=verifiers env.id=ID +env.args.KEY=VALUE eval.model=DIR eval.samples_per_task=8 eval.k=8

By default (`eval.held_out=true`) the env's held-out split is used where it has one: `env.eval_args` merged over
`env.args` (primerl-reverse-text: `{stream: eval}`, texts disjoint from its RL and SFT streams).

Prints and writes to `<output_dir>/eval.json`: mean reward with its standard error, avg@k, unbiased pass@k (a
rollout passes when its reward is at least `eval.success_threshold`), each reward function's and env metric's
mean, and the failed rollouts by reason (counted, never scored). Records an MLflow run (tag `primerl.kind=eval`,
`eval.model` = the directory evaluated) with the scores as `eval/<env id>/...` at the evaluated step. A LoRA run's
policy (an adapter directory, by `eval.run` or `eval.model`) is served over the base model its adapter_config.json
names.
"""

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from primerl.app import hydra_app, to_run_config
from primerl.config.env import EnvConfig
from primerl.config.model import LoraConfig
from primerl.config.schema import RunConfig
from primerl.envs.scoring import TaskResult, run_tasks, summarize
from primerl.model.adapter import adapter_settings
from primerl.transport.atomic import is_stable, write_json
from primerl.transport.run_dir import eval_summary_path, ledger_record_path, weights_path
from primerl.transport.weights import is_adapter, is_offer, latest_stable_version
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger
from primerl.utils.process import free_port

log = get_logger("eval")


def model_to_evaluate(cfg: RunConfig) -> tuple[str, int | None]:
    """(model directory, policy step or None) named by `eval.model` or `eval.run` (+ `eval.step`)."""
    e = cfg.eval
    if (e.model is None) == (e.run is None):
        raise ConfigError("eval.model", "give exactly one of eval.model=<model dir> or eval.run=<run dir>")
    if e.model is not None:
        path = Path(e.model).expanduser()
        if not (path / "config.json").exists() and not is_adapter(path):
            raise ConfigError(
                "eval.model", f"{e.model} is neither a Hugging Face model directory nor a LoRA adapter (no config.json)"
            )
        return str(path.resolve()), None
    run = Path(e.run).expanduser()
    step = e.step if e.step is not None else latest_stable_version(run)
    if step is None:
        raise ConfigError("eval.run", f"{e.run} has no published policy (no stable weights/step_*)")
    if not is_stable(weights_path(run, step)):
        raise ConfigError("eval.step", f"{weights_path(run, step)} is not a stable published policy")
    if is_offer(weights_path(run, step)):
        raise ConfigError(
            "eval.step" if e.step is not None else "eval.run",
            f"policy v{step} of {e.run} went by collective (weights.transport=collective) and holds no weights to "
            "serve; evaluate the run once it ended (its last version is written as files), or a model directory",
        )
    return str(weights_path(run, step).resolve()), step


def held_out_env(cfg: RunConfig) -> EnvConfig:
    """The env with its `eval_args` (its held-out split) merged over its args; the env itself when it has none."""
    if not cfg.env.eval_args:
        log.warning(f"env {cfg.env.id} has no held-out split (env.eval_args): evaluating on its own tasks")
        return cfg.env
    return cfg.env.held_out()


@contextlib.contextmanager
def served_at(cfg: RunConfig, model_path: str, device: str, adapter: str | None) -> Iterator[str]:
    """The URL to evaluate against, served while the context lasts: one server (one replica is enough to evaluate),
    or with `inference.pd.enabled` one prefill/decode pair behind primerl's router at `inference.port`, as a training
    run serves them (primerl.inference.serving)."""
    from primerl.inference.serving import server_for, serving
    from primerl.inference.vllm_args import render_specs

    inf = dataclasses.replace(cfg.inference, replicas=1)
    cfg = dataclasses.replace(cfg, inference=inf)
    specs = render_specs(cfg, model_path, device, adapter)
    with serving(cfg.inference, cfg.output_dir, [server_for(cfg.output_dir, spec) for spec in specs]):
        yield f"http://{inf.host}:{inf.port}"


def evaluate(cfg: RunConfig, model_path: str) -> dict:
    """Serve `model_path`, run the env's tasks, return the summary (also what `eval.json` holds)."""
    from primerl.envs.verifiers_env import load_env
    from primerl.inference.engine_support import check_servable, check_supported, resolve_device

    e = cfg.eval
    inf = dataclasses.replace(cfg.inference, port=cfg.inference.port or free_port())
    env_cfg = held_out_env(cfg) if e.held_out else cfg.env
    cfg = dataclasses.replace(cfg, inference=inf, env=env_cfg)
    env = load_env(cfg.env)
    tasks = list(itertools.islice(iter(env.taskset), e.num_tasks))
    if len(tasks) < e.num_tasks:
        log.warning(f"the env has {len(tasks)} tasks, fewer than eval.num_tasks={e.num_tasks}")
    device = resolve_device(inf)
    check_supported(inf, device)
    adapter = None
    if is_adapter(model_path):  # a LoRA run's policy: served over the base model it names
        adapter, (model_path, rank) = model_path, adapter_settings(model_path)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig(rank=rank)))
    check_servable(cfg.model, model_path, device)
    logging.getLogger("verifiers.v1.interception.server").setLevel(logging.ERROR)
    with served_at(cfg, model_path, device, adapter) as base_url:
        started = time.perf_counter()
        results = run_served(cfg, env, tasks, model_path, base_url)
        wall_s = time.perf_counter() - started
    return summary(cfg, adapter or model_path, results, wall_s)


def run_served(cfg: RunConfig, env, tasks: list, model_path: str, base_url: str) -> list[TaskResult]:
    """`eval.samples_per_task` rollouts of each task against the server at `base_url`, with a progress bar."""
    from primerl.envs.verifiers_env import env_runner

    e = cfg.eval
    max_tokens = e.max_tokens or cfg.orchestrator.max_tokens
    sampling = cfg.orchestrator.sampling_args
    runner = env_runner(env, model_path, cfg.inference, e.temperature, max_tokens, sampling, base_url)

    async def main() -> list[TaskResult]:
        with tqdm(total=len(tasks) * e.samples_per_task, desc="eval", dynamic_ncols=True) as bar:
            async with env.serving():
                timeout_s = cfg.orchestrator.rollout_timeout_s
                return await run_tasks(runner, tasks, e.samples_per_task, e.max_inflight, timeout_s, bar.update)

    return asyncio.run(main())


def summary(cfg: RunConfig, model: str, results: list[TaskResult], wall_s: float) -> dict:
    """What `eval.json` holds: the settings that shaped the scores, the scores, and why rollouts failed."""
    e = cfg.eval
    reasons = collections.Counter(reason for r in results for reason in r.failures)
    return {
        "model": model,
        "env": cfg.env.id,
        "env_args": dict(cfg.env.args),
        "samples_per_task": e.samples_per_task,
        "k": e.k,
        "temperature": e.temperature,
        "success_threshold": e.success_threshold,
        "wall_s": wall_s,
        **summarize(results, e.k, e.success_threshold),
        "failure_reasons": dict(reasons.most_common()),
    }


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    model_path, step = model_to_evaluate(cfg)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info(f"evaluating {model_path} on {cfg.env.id} ({cfg.eval.num_tasks} tasks x {cfg.eval.samples_per_task})")
    summary = evaluate(cfg, model_path) | {"step": step}
    write_json(eval_summary_path(out_dir), summary, indent=1)
    k, env_id = cfg.eval.k, cfg.env.id
    if "reward_mean" in summary:
        log.info(
            f"{env_id}: reward {summary['reward_mean']:.3f} ± {summary['reward_stderr']:.3f} over "
            f"{summary['rollouts']:.0f} rollouts of {summary['tasks']:.0f} tasks; avg@{k} "
            f"{summary.get(f'avg@{k}', float('nan')):.3f}, pass@{k} {summary.get(f'pass@{k}', float('nan')):.3f}; "
            f"{summary['failures']:.0f} failed"
        )
    else:
        log.error(f"{env_id}: every rollout failed: {summary['failure_reasons']}")
    log.info(f"summary in {eval_summary_path(out_dir)}")
    if cfg.ledger.enabled:
        from primerl.ledger.mlflow_ledger import Ledger

        ledger = Ledger.open(cfg, dict_cfg, out_dir.resolve(), kind="eval")
        ledger.set_tags({"eval.model": model_path, "eval.env": env_id, **scored_run(cfg, step)})
        # MLflow metric names take no "@"
        numbers = {key.replace("@", "_at_"): value for key, value in summary.items() if isinstance(value, int | float)}
        ledger.log_metrics(step or 0, numbers, f"eval/{env_id}/")
        ledger.log_artifact(eval_summary_path(out_dir))
        ledger.finish()


def scored_run(cfg: RunConfig, step: int | None) -> dict[str, str]:
    """The tags that link an eval of a run's policy to that run's MLflow record (its `ledger.json`), when it has one."""
    record = ledger_record_path(cfg.eval.run) if cfg.eval.run else None
    if record is None or not record.is_file():
        return {}
    return {"eval.run_id": json.loads(record.read_text())["run_id"], "eval.step": str(step)}


if __name__ == "__main__":
    main()
