"""Secrets in a run: where they come from, and how they are kept out of argv, logs and records.

The one secret in the config is the inference servers' key, `inference.api_key`; a Prometheus scrape token
(METRICS_TOKEN_ENV) is only ever read from the environment. Its default reads the environment variable
API_KEY_ENV, so every process of a run finds it there. A key given on the command line is moved there by the driver
(primerl.launch.driver): children get it in their environment, never in their argv. Every record (MLflow params,
tags and config artifacts, the W&B config, the run's `.hydra/` files) shows MASK in its place.
"""

import re

API_KEY_ENV = "PRIMERL_API_KEY"
METRICS_TOKEN_ENV = "PRIMERL_METRICS_TOKEN"  # what a Prometheus scrape presents, when not the run's key
SECRET_KEYS = ("inference.api_key",)
MASK = "***"
_OVERRIDE = re.compile(r"^(\+{0,2})(" + "|".join(re.escape(k) for k in SECRET_KEYS) + r")=(.*)$")


def split_secret_overrides(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the overrides without secrets, {key: value} of the secrets they held)."""
    kept, secrets = [], {}
    for override in overrides:
        found = _OVERRIDE.match(override)
        if found:
            secrets[found.group(2)] = found.group(3)
        else:
            kept.append(override)
    return kept, secrets


def mask_overrides(overrides: list[str]) -> list[str]:
    return [_OVERRIDE.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}", o) for o in overrides]


def mask_params(params: dict[str, str]) -> dict[str, str]:
    """Flattened config params with every secret's value masked (a secret left unset stays `None`)."""
    return {k: (MASK if k in SECRET_KEYS and v not in ("None", "", None) else v) for k, v in params.items()}


def mask_text(text: str, secrets: list[str | None]) -> str:
    """`text` with every occurrence of each (non-empty) secret value replaced by MASK."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
