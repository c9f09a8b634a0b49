"""Checks of the RL algorithm's settings (trainer.loss, trainer.lr_schedule, orchestrator.advantage and .filter),
each failure one ConfigError naming the key, before any process starts."""

from primerl.config.orchestrator import ADMISSIONS, ADVANTAGES
from primerl.config.schema import RunConfig
from primerl.config.trainer import (
    CUSTOM_LOSS_PARAMETERS,
    LOSS_TYPES,
    LR_SCHEDULES,
    OFF_POLICY_CORRECTIONS,
    OFF_POLICY_LEVELS,
    REDUCTIONS,
)
from primerl.utils.dotted import load_function
from primerl.utils.errors import ConfigError


def _one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, f"'{value}' is not one of [{', '.join(choices)}]")


def check_algorithm(cfg: RunConfig) -> None:
    loss, orch = cfg.trainer.loss, cfg.orchestrator
    _one_of("trainer.loss.type", loss.type, LOSS_TYPES)
    _one_of("trainer.loss.reduction", loss.reduction, REDUCTIONS)
    _one_of("trainer.lr_schedule.type", cfg.trainer.lr_schedule.type, LR_SCHEDULES)
    _one_of("orchestrator.advantage", orch.advantage, ADVANTAGES)
    _one_of("orchestrator.admission", orch.admission, ADMISSIONS)
    off = loss.off_policy
    _one_of("trainer.loss.off_policy.correction", off.correction, OFF_POLICY_CORRECTIONS)
    _one_of("trainer.loss.off_policy.level", off.level, OFF_POLICY_LEVELS)
    if off.correction == "mask" and not off.low < 1 < off.high:
        raise ConfigError(
            "trainer.loss.off_policy.low",
            f"the kept range [{off.low}, {off.high}] (low, high) must bracket 1, or every on-policy token is masked",
        )
    if off.correction == "tis" and off.high < 1:
        raise ConfigError(
            "trainer.loss.off_policy.high", f"the cap {off.high} is below 1: on-policy tokens would shrink"
        )
    updates = cfg.trainer.mini_batches * cfg.trainer.epochs
    if off.correction != "none" and updates > 1 and cfg.parallelism.cp > 1:
        raise ConfigError(
            "trainer.mini_batches",
            "several updates per batch with an off-policy correction keep each token's first-pass log-prob, which "
            "context parallel splits; parallelism.cp must be 1",
        )
    if off.correction != "none" and off.level != "token" and cfg.parallelism.cp > 1:
        raise ConfigError(
            "trainer.loss.off_policy.level", "a sequence-level weight needs whole sequences; parallelism.cp must be 1"
        )
    if not loss.clip_ratio_low < 1 < loss.clip_ratio_high:
        raise ConfigError(
            "trainer.loss.clip_ratio_low",
            f"the clip range [{loss.clip_ratio_low}, {loss.clip_ratio_high}] (clip_ratio_low, clip_ratio_high) "
            "must bracket 1",
        )
    if loss.type == "custom":
        if not loss.custom:
            raise ConfigError("trainer.loss.custom", "trainer.loss.type=custom needs 'package.module:function'")
        load_function(loss.custom, CUSTOM_LOSS_PARAMETERS, "trainer.loss.custom")
    elif loss.custom:
        raise ConfigError("trainer.loss.custom", f"is set, but trainer.loss.type is {loss.type}, not custom")
    if loss.type == "gspo" and cfg.parallelism.cp > 1:
        raise ConfigError("trainer.loss.type", "gspo's sequence ratio needs whole sequences; parallelism.cp must be 1")
    _check_filter(cfg)


def _check_filter(cfg: RunConfig) -> None:
    keep, group_size = cfg.orchestrator.filter, cfg.orchestrator.group_size
    low = 0.0 if keep.min_pass_rate is None else keep.min_pass_rate
    high = float("inf") if keep.max_pass_rate is None else keep.max_pass_rate
    if low > high:
        raise ConfigError(
            "orchestrator.filter.min_pass_rate", f"{low} is above orchestrator.filter.max_pass_rate={high}"
        )
    if keep.zero_variance and group_size == 1:
        raise ConfigError(
            "orchestrator.filter.zero_variance", "every group of orchestrator.group_size=1 has zero variance"
        )
    if keep.zero_variance and keep.min_pass_rate is not None and keep.max_pass_rate is not None:
        # with rewards in [0, 1], a band inside (0, 1) is needed once all-0 and all-1 groups are rejected
        if high <= 0.0 or low >= 1.0:
            raise ConfigError(
                "orchestrator.filter.max_pass_rate",
                f"the band [{low}, {high}] with zero_variance rejects every group of 0/1 rewards",
            )
