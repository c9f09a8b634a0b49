"""SFT demonstrations an env generates itself: the one hook primerl looks for in an env package.

The env package is the module verifiers imports for the env id (`a-b` -> `a_b`). It may define

    def demonstrations(count: int, seed: int, env_args: dict, **options) -> list[dict]

returning `count` chat rows in the format of `sft.data` ({"messages": [...], "tools": [...]}, tools optional;
primerl.sft.data), the same rows for the same arguments, drawn from a stream disjoint from the env's RL and eval tasks.
`env_args` is the run's `env.args`; `options` is `sft.demonstration_args`, and a ValueError or TypeError the hook
raises for them is reported as a one-line config error of that key. It may also define `DEMONSTRATIONS_VERSION`
(an int, 1 when absent): it is part of the warm-start's cache key, so bump it whenever the generator's output
changes, or runs keep reusing warm-starts trained on the old demonstrations.
"""

import importlib
from collections.abc import Callable
from types import ModuleType

from primerl.utils.errors import ConfigError

HOOK, VERSION = "demonstrations", "DEMONSTRATIONS_VERSION"


def env_module(env_id: str) -> ModuleType | None:
    """The env's package, or None when it is not installed (load_env reports that case)."""
    name = env_id.replace("-", "_")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        return None


def demonstration_hook(env_id: str) -> Callable[..., list[dict]] | None:
    return getattr(env_module(env_id), HOOK, None)


def demonstrations_version(env_id: str) -> int:
    return int(getattr(env_module(env_id), VERSION, 1))


def generate(env_id: str, count: int, seed: int, env_args: dict, options: dict) -> list[dict]:
    """`count` rows from the env's hook (which must exist)."""
    hook = demonstration_hook(env_id)
    if hook is None:
        raise ConfigError("sft.data", f"env.id={env_id} generates no demonstrations (no `{HOOK}` in its package)")
    try:
        return hook(count, seed, dict(env_args), **options)
    except (ValueError, TypeError) as err:
        raise ConfigError("sft.demonstration_args", f"{env_id}: {err}") from err
