"""Ranges declared on the field they bound, and one check for all of them.

    batch_size: int = bounded(64, ge=1)
    temperature: float = bounded(1.0, gt=0)

`check_bounds(cfg)` walks the whole config tree and raises a ConfigError naming the first field outside its range
(before any process starts; `validate` calls it). `tests/test_config.py` reads the same declarations to try a value
outside every range. A field left None (optional) is not checked.
"""

import dataclasses
import operator
from typing import Any

from primerl.utils.errors import ConfigError

_OPS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def bounded(default: Any, **limits: float) -> Any:
    """A dataclass field with a default and its limits (ge, gt, le, lt)."""
    assert limits and set(limits) <= set(_OPS), limits
    return dataclasses.field(default=default, metadata={"bounds": limits})


def bounds_of(field: dataclasses.Field) -> dict[str, float]:
    return dict(field.metadata.get("bounds", {}))


def violation(value: Any, limits: dict[str, float]) -> str | None:
    """Why `value` is out of `limits`, or None; None itself (an optional setting left unset) is within any."""
    if value is None:
        return None
    for name, limit in limits.items():
        op, text = _OPS[name]
        if not op(value, limit):
            return f"must be {text} {limit:g}, got {value}"
    return None


def check_bounds(node: Any, prefix: str = "") -> None:
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{key}.")
        elif value is not None and (why := violation(value, bounds_of(field))):
            raise ConfigError(key, why)
