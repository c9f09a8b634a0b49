"""Env group: which verifiers environment rollouts come from."""

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class EnvConfig:
    id: str = MISSING  # set by the env group; `env=verifiers` asks for it on the command line
    args: dict[str, Any] = field(default_factory=dict)
