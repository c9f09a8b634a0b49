"""Functions named by the user as "package.module:function" (a custom loss), imported and checked once."""

import importlib
import inspect
from collections.abc import Callable
from functools import cache

from primerl.utils.errors import ConfigError


@cache
def load_function(path: str, parameters: tuple[str, ...], key: str) -> Callable:
    """The function at `path`, checked: it imports and its parameters are exactly `parameters`. Anything else is a
    ConfigError naming `key` (the config key that holds the path)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(key, f"{path!r} is not of the form 'package.module:function'")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(key, f"{path!r} does not import: {err}") from err
    try:
        found = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError) as err:
        raise ConfigError(key, f"{path!r} is not a function: {err}") from err
    if found != parameters:
        raise ConfigError(key, f"{path} takes {found}; it must take {parameters}")
    return function
