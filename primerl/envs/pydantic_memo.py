"""One memo for pydantic, installed by the process that runs rollouts.

pydantic 2.14's `model_construct` asks, for every field left to its `default_factory`, whether the factory takes the
validated data: `inspect.signature(factory)`, recomputed each time. For builtins (`list`, `time.time`) that parses a
text signature, about 0.2 ms per field. verifiers builds several `MessageNode`s per rollout turn that way
(`graph._commit_turn`): ~1 ms per node, the largest single CPU cost of a rollout in a profile of
`benchmarks/inference.py`. The answer is a pure function of the factory, so it is memoised here.
Upstream: pydantic/pydantic#13376 (the same for PrivateAttr).
"""

from collections.abc import Callable

import pydantic

from primerl.utils.log import get_logger

log = get_logger(__name__)
_answers: dict[Callable, bool] = {}


def memoize_default_factory_check() -> None:
    """Idempotent; factories that cannot be hashed are checked every time. On a pydantic without the private function
    this memoises, a warning, and rollouts run unmemoised (slower, the same results)."""
    try:
        from pydantic._internal import _fields

        original = _fields.takes_validated_data_argument
    except (ImportError, AttributeError):
        log.warning(f"pydantic {pydantic.VERSION}: no default-factory check to memoise; rollouts run without it")
        return
    if getattr(original, "_primerl_memo", False):
        return

    def takes_validated_data_argument(default_factory: Callable) -> bool:
        try:
            return _answers[default_factory]
        except KeyError:
            answer = _answers[default_factory] = original(default_factory)
            return answer
        except TypeError:  # unhashable
            return original(default_factory)

    takes_validated_data_argument._primerl_memo = True  # type: ignore[attr-defined]
    _fields.takes_validated_data_argument = takes_validated_data_argument
