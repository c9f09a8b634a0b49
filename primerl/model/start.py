"""Which weights a run starts from: the SFT warm-start checkpoint (cached, keyed by what changes it) or the base model.

Every process asks this module, so inference serves, the orchestrator tokenizes for and the trainer trains the same
start weights.
"""

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.model.resolve import base_model_path


def sft_checkpoint_dir(cfg: RunConfig) -> Path:
    """Keyed by everything that changes the SFT result, so a finished warm-start is reused by later runs."""
    key = json.dumps(
        [base_model_path(cfg), asdict(cfg.sft) | {"save_every": None}, cfg.env.id, cfg.env.args, cfg.seed],
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(os.path.expanduser(cfg.cache_dir)) / "sft" / f"{cfg.name}-{digest}"


def initial_model_path(cfg: RunConfig) -> str:
    """The weights RL starts from: the SFT checkpoint when SFT is enabled, else the base model."""
    return str(sft_checkpoint_dir(cfg)) if cfg.sft.enabled else base_model_path(cfg)
