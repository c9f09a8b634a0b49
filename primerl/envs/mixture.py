"""A training mixture: several envs, each task drawn from one of them by sampling weight.

The mixed stream is a pure function of the seed and the envs' own streams: draw i picks env `name` with probability
weight / sum of weights (`random.Random(f"{seed}/mixture")`), then takes that env's next task. So a restarted
orchestrator that skips the first `position` draws (primerl.orchestrator.source) continues the same stream, and no
task is drawn twice. A group is one task's rollouts, so a group never mixes envs; task keys are `<env id>/<key>`,
which the orchestrator's per-env metrics (`env/<id>/...`) read back. The stream ends when the env drawn has run out.
"""

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class MixedTask:
    env: str
    task: Any

    @property
    def key(self) -> str:
        return f"{self.env}/{getattr(self.task, 'key', '')}"


def mixed_tasks(streams: dict[str, Iterable], weights: dict[str, float], seed: int) -> Iterator[MixedTask]:
    rng = random.Random(f"{seed}/mixture")
    names = list(streams)
    iterators = {name: iter(stream) for name, stream in streams.items()}
    while True:
        name = rng.choices(names, [weights[n] for n in names])[0]
        task = next(iterators[name], None)
        if task is None:
            return
        yield MixedTask(name, task)


class MixtureRunner:
    """Runs a MixedTask with its env's runner."""

    def __init__(self, runners: dict[str, Any]):
        self.runners = runners

    async def run(self, mixed: MixedTask, seed: int | None = None) -> list:
        return await self.runners[mixed.env].run(mixed.task, seed)


def env_of(task_key: str, names: Iterable[str]) -> str | None:
    """The mixture env a task key belongs to."""
    return next((name for name in names if task_key.startswith(f"{name}/")), None)
