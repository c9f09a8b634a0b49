"""`python -m primerl.orchestrator`: rollouts -> advantages -> packed batches for the trainer, policy updates -> vLLM.

Loop for trainer step n = start..max_steps-1:
  1. wait until the policy served is at least version n - async_level (loading each newer published weight
     directory into vLLM in place); async_level=0 is fully synchronous;
  2. run batch_size/group_size tasks x group_size rollouts through verifiers' train client (token ids,
     sampled mask, logprobs), count and drop failed rollouts and samples older than the bound;
  3. compute group-relative advantages, pack into micro-batches of trainer.seq_len, write step n's batch.
Every sample carries the policy version that produced it. Metrics go to <run>/metrics/orchestrator.jsonl.
"""

import asyncio
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
from primerl.inference.server import SERVED_MODEL_NAME, load_weights
from primerl.metrics import append_metrics
from primerl.orchestrator.advantages import group_advantages
from primerl.orchestrator.batch import build_batch, drop_stale, required_policy_version
from primerl.sft.checkpoint import initial_model_path
from primerl.transport import Sample, latest_stable_version, rollout_path, weights_path, write_rollout_batch

API_KEY_VAR = "PRIMERL_INFERENCE_API_KEY"


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
        os.environ.setdefault(API_KEY_VAR, cfg.inference.api_key or "EMPTY")
        self.ctx = vf.ModelContext(
            client=vf.TrainClientConfig(base_url=f"{self.base_url}/v1", api_key_var=API_KEY_VAR,
                                        renderer_model_name=self.model_path),  # fmt: skip
            model=SERVED_MODEL_NAME,
            sampling=vf.SamplingConfig(temperature=cfg.orchestrator.temperature,
                                       max_tokens=cfg.orchestrator.max_tokens),  # fmt: skip
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
        for reason in sorted(set(failures))[:3]:
            print(f"orchestrator: step {step}: failed rollout: {reason}", flush=True)
        stats = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "rollouts/ok": float(len(rewards)),
            "rollouts/failed": float(len(failures)),
            **{f"reward/{name}": sum(v) / len(v) for name, v in per_fn.items()},
        }
        return samples, stats, examples

    async def run(self) -> None:
        cfg, orch = self.cfg, self.cfg.orchestrator
        await self.wait_for_server(cfg.inference.startup_timeout_s)
        start = 0
        while rollout_path(self.run_dir, start).exists():  # resume: batches already handed over stay as they are
            start += 1
        self.tasks = itertools.islice(iter(self.env.taskset), start * (orch.batch_size // orch.group_size), None)
        for step in range(start, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            need = required_policy_version(step, orch.async_level)
            load_s = self.update_policy()
            while self.version < need:
                await asyncio.sleep(0.2)
                load_s += self.update_policy()
            waited = time.perf_counter() - t0 - load_s
            t1 = time.perf_counter()
            samples, stats, examples = await self.generate(step)
            gen_s = time.perf_counter() - t1
            samples, dropped = drop_stale(samples, step, orch.async_level)
            if not samples:
                print(f"orchestrator: step {step}: every rollout failed; retrying the step", flush=True)
                continue
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
                                self.tokenizer.pad_token_id, stats)  # fmt: skip
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
