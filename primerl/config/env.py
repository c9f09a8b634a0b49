"""Env group: which verifiers environment rollouts come from."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from primerl.utils.bounds import bounded


@dataclass
class EnvConfig:
    id: str = MISSING  # a verifiers taskset id; `env=verifiers` asks for it on the command line
    harness: str = "primerl-chat"  # in-process chat loop: no uv, sandbox or network per rollout
    # the harness's own config fields (primerl-chat: max_turns, token_budget, tool_timeout_s)
    harness_args: dict[str, Any] = field(default_factory=dict)
    runtime: str = "subprocess"
    args: dict[str, Any] = field(default_factory=dict)  # the taskset's own config fields
    # merged over `args` for evaluation: the env's held-out split (e.g. primerl-reverse-text's {stream: eval}); the default
    # online eval env when there is one (primerl.config.eval)
    eval_args: dict[str, Any] = field(default_factory=dict)
    # rollouts run in this many worker processes (a verifiers EnvServer each; primerl.envs.workers), not in the
    # orchestrator's event loop: an env's CPU work or crash then costs only its own rollouts. 0: in-process.
    workers: int = bounded(0, ge=0)
    # a worker that shows no sign of life (no health answer, no rollout finished) for this long, its event loop
    # blocked, is killed and restarted (primerl.utils.liveness)
    worker_timeout_s: float = bounded(30.0, gt=0)
    # the same limit for a worker that has not finished its first rollout yet (imports, warm-up); at least the above
    worker_grace_s: float = bounded(60.0, gt=0)

    def held_out(self) -> "EnvConfig":
        """This env with `eval_args` merged over `args`: its held-out split (itself when it names none)."""
        return dataclasses.replace(self, args={**self.args, **self.eval_args})


@dataclass
class MixtureEntry(EnvConfig):
    """One env of a training mixture (`mixture: [...]` at the top of the config; it replaces `env`)."""

    weight: float = 1.0  # sampling weight: each task is drawn from this env with probability weight / sum of weights
