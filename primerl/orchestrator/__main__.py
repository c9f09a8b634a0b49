"""`python -m primerl.orchestrator`: rollouts -> advantages -> packed batches for the trainer, policy updates -> vLLM.

Loop for trainer step n = start..max_steps-1:
  1. wait until the policy served is at least version n - async_level (loading each newer published weight
     directory into vLLM in place); async_level=0 is fully synchronous;
  2. run batch_size/group_size tasks x group_size rollouts through verifiers' train client (token ids,
     sampled mask, logprobs), count and drop failed rollouts and samples older than the bound;
  3. compute group-relative advantages, pack into micro-batches of trainer.seq_len, write step n's batch.
Every sample carries the policy version that produced it. Metrics go to <run>/metrics/orchestrator.jsonl.

State across a restart: the batches themselves. A restarted orchestrator goes on at the first step without a
batch, from the data position (tasks consumed) stored in the last batch. It has no RNG of its own: sampling
randomness is vLLM's (verifiers' SamplingConfig takes no seed). A step whose rollouts all failed, or that met a
dead server, is retried after waiting for the server with back-off; it never skips a step.
"""

import asyncio
import collections
import itertools
import json
import os
import time
from pathlib import Path

import httpx
import verifiers.v1 as vf
from omegaconf import DictConfig
from transformers import AutoTokenizer

from primerl.config.cli import hydra_app, to_run_config
from primerl.config.schema import RunConfig
from primerl.envs.verifiers_env import Rollout, RolloutFailure, episode_rollouts, load_env
from primerl.inference.server import SERVED_MODEL_NAME, load_weights, policy_version
from primerl.metrics import append_metrics, append_metrics_once
from primerl.orchestrator.advantages import group_advantages
from primerl.orchestrator.batch import build_batch, drop_stale, required_policy_version
from primerl.sft.checkpoint import initial_model_path
from primerl.transport import (
    Sample,
    latest_stable_version,
    read_rollout_batch,
    rollout_path,
    weights_path,
    write_rollout_batch,
)

API_KEY_VAR = "PRIMERL_INFERENCE_API_KEY"
MAX_ATTEMPTS_PER_STEP = 5  # a step whose rollouts all fail this often is an environment bug, not bad luck


class Orchestrator:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.base_url = f"http://{cfg.inference.host}:{cfg.inference.port}"
        self.model_path = initial_model_path(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.env = load_env(cfg.env)
        self.tasks = iter(())  # set in run(), past the tasks of batches already handed over
        self.version = 0
        self.data_position = 0  # tasks consumed so far (a retried step consumes new ones)
        os.environ.setdefault(API_KEY_VAR, cfg.inference.api_key or "EMPTY")
        self.ctx = vf.ModelContext(
            client=vf.TrainClientConfig(
                base_url=f"{self.base_url}/v1", api_key_var=API_KEY_VAR, renderer_model_name=self.model_path
            ),  # fmt: skip
            model=SERVED_MODEL_NAME,
            sampling=vf.SamplingConfig(
                temperature=cfg.orchestrator.temperature, max_tokens=cfg.orchestrator.max_tokens
            ),  # fmt: skip
        )
        self.semaphore = asyncio.Semaphore(256)

    async def wait_for_server(self, timeout_s: float) -> None:
        """Block until vLLM answers /health, backing off up to 10 s between probes."""
        deadline, delay = time.monotonic() + timeout_s, 0.5
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                try:
                    if (await client.get(f"{self.base_url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"inference server {self.base_url} not healthy after {timeout_s:.0f}s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    def update_policy(self) -> float:
        """Load the newest published weights into vLLM if newer than what it serves; returns seconds spent."""
        latest = latest_stable_version(self.run_dir)
        if latest is None or latest <= self.version:
            return 0.0
        seconds = load_weights(self.base_url, weights_path(self.run_dir, latest), latest, self.cfg.inference.api_key)
        print(f"orchestrator: policy v{self.version} -> v{latest} loaded in {seconds:.2f}s", flush=True)
        self.version = latest
        return seconds

    async def run_group(self, task) -> list[Rollout | RolloutFailure]:
        slots = self.env.slots(task, self.cfg.orchestrator.group_size)
        timeout = self.cfg.orchestrator.rollout_timeout_s

        async def one(slot) -> list[Rollout | RolloutFailure]:
            try:
                episode = await asyncio.wait_for(self.env.run_slot(slot, self.ctx, self.semaphore), timeout)
            except TimeoutError:
                return [RolloutFailure(f"rollout exceeded orchestrator.rollout_timeout_s={timeout:g}")]
            return episode_rollouts(episode)

        results = await asyncio.gather(*(one(s) for s in slots))
        return [r for per_slot in results for r in per_slot]

    async def generate(self, step: int) -> tuple[list[Sample], dict[str, float], list[dict]]:
        cfg = self.cfg.orchestrator
        tasks = list(itertools.islice(self.tasks, cfg.batch_size // cfg.group_size))
        self.data_position += len(tasks)
        if not tasks:
            raise RuntimeError(f"environment '{self.cfg.env.id}' ran out of tasks at step {step}")
        version = self.version  # no weight load happens while a batch is in flight
        groups = await asyncio.gather(*(self.run_group(t) for t in tasks))
        samples, failures, examples = [], [], []
        rewards: list[float] = []
        per_fn: dict[str, list[float]] = {}
        for task, group in zip(tasks, groups):
            ok = [r for r in group if isinstance(r, Rollout)]
            failures += [r.reason for r in group if isinstance(r, RolloutFailure)]
            for rollout, adv in zip(ok, group_advantages([r.reward for r in ok])):
                rewards.append(rollout.reward)
                for name, score in rollout.rewards.items():
                    per_fn.setdefault(name, []).append(score)
                for b in rollout.branches:
                    samples.append(Sample(b.token_ids, b.sampled_mask, b.logprobs, rollout.reward, adv, version,
                                          str(task.key)))  # fmt: skip
                if len(examples) < 4:
                    examples.append({"step": step, "task": str(task.data.prompt_text)[:500],
                                     "completion": rollout.completion[:500], "reward": rollout.reward})  # fmt: skip
        for reason, count in collections.Counter(failures).most_common(8):
            print(f"orchestrator: step {step}: {count} failed rollout(s): {reason}", flush=True)
        stats = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "rollouts/ok": float(len(rewards)),
            "rollouts/failed": float(len(failures)),
            **{f"reward/{name}": sum(v) / len(v) for name, v in per_fn.items()},
        }
        return samples, stats, examples

    async def recover_server(self) -> None:
        """After failed rollouts or a failed weight load: if the server died or restarted, wait for it with back-off,
        then resync the policy version it serves (a restarted server serves the start weights again)."""
        try:
            served = policy_version(self.base_url, self.cfg.inference.api_key)
        except httpx.HTTPError:
            print(f"orchestrator: inference server {self.base_url} unreachable; waiting with back-off", flush=True)
            await self.wait_for_server(self.cfg.inference.startup_timeout_s)
            served = policy_version(self.base_url, self.cfg.inference.api_key)
        if served != self.version:
            print(f"orchestrator: the server serves policy v{served}, not v{self.version}: reloading", flush=True)
            self.version = served
            self.update_policy()

    def resume_point(self) -> int:
        """The first step without a batch. Batches already handed over stay as they are; the data position and any
        metrics row that a killed predecessor did not write come back from the batches' metadata."""
        start = 0
        while rollout_path(self.run_dir, start).exists():
            start += 1
        for step in range(max(0, start - self.cfg.orchestrator.async_level - 1), start):
            batch = read_rollout_batch(rollout_path(self.run_dir, step))
            append_metrics_once(self.run_dir, "orchestrator", step, batch.metrics)
            self.data_position = batch.data_position
        if start:
            print(f"orchestrator: resuming at step {start}, task {self.data_position}", flush=True)
        return start

    async def policy_for(self, step: int) -> tuple[float, float]:
        """Wait until the served policy is recent enough for `step`; returns (seconds waited, seconds loading)."""
        t0 = time.perf_counter()
        need = required_policy_version(step, self.cfg.orchestrator.async_level)
        load_s = self.update_policy()
        while self.version < need:
            await asyncio.sleep(0.2)
            load_s += self.update_policy()
        return time.perf_counter() - t0 - load_s, load_s

    async def run(self) -> None:
        cfg, orch = self.cfg, self.cfg.orchestrator
        await self.wait_for_server(cfg.inference.startup_timeout_s)
        start = self.resume_point()
        self.tasks = itertools.islice(iter(self.env.taskset), self.data_position, None)
        for step in range(start, cfg.trainer.max_steps):
            attempts = 0
            while True:  # a step is retried until it has samples: failed rollouts or a dead server lose no step
                attempts += 1
                try:
                    waited, load_s = await self.policy_for(step)
                    t1 = time.perf_counter()
                    samples, stats, examples = await self.generate(step)
                    gen_s = time.perf_counter() - t1
                except httpx.HTTPError as err:
                    print(f"orchestrator: step {step}: {type(err).__name__}: {err}", flush=True)
                    await self.recover_server()
                    continue
                samples, dropped = drop_stale(samples, step, orch.async_level)
                if samples:
                    break
                if attempts >= MAX_ATTEMPTS_PER_STEP:
                    raise RuntimeError(f"step {step}: every rollout failed {attempts} times in a row; the reasons "
                                       "are logged above (environment, reward function or server)")  # fmt: skip
                print(f"orchestrator: step {step}: every rollout failed; retrying the step", flush=True)
                await self.recover_server()
            completion_tokens = sum(sum(s.sampled_mask) for s in samples)
            stats |= {
                "off_policy/max_lag": float(step - min(s.policy_version for s in samples)),
                "off_policy/dropped": float(dropped),
                "policy_version": float(self.version),
                "time/wait_policy_s": waited,
                "time/weight_load_s": load_s,
                "time/generate_s": gen_s,
                "throughput/completion_tokens_per_s": completion_tokens / max(gen_s, 1e-9),
                "seq_len/mean": sum(len(s.token_ids) for s in samples) / len(samples),
            }
            batch = build_batch(samples, step, cfg.trainer.seq_len, cfg.trainer.micro_batch_size,
                                self.tokenizer.pad_token_id, stats, self.data_position)  # fmt: skip
            write_rollout_batch(self.run_dir, batch)
            append_metrics(self.run_dir, "orchestrator", step, stats)
            with open(self.run_dir / "rollouts" / "samples.jsonl", "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in examples)
            print(f"orchestrator: step {step}: reward {stats['reward/mean']:.3f}, {len(samples)} samples "
                  f"(policy v{self.version}, failed {int(stats['rollouts/failed'])}), {gen_s:.1f}s", flush=True)  # fmt: skip


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)

    async def run() -> None:
        orchestrator = Orchestrator(cfg)
        async with orchestrator.env.serving():
            await orchestrator.run()

    asyncio.run(run())


if __name__ == "__main__":
    main()
