"""Where the SFT warm-start's result is cached: a directory keyed by everything that changes it (the base model, the
SFT settings, the env and its demonstrations or dataset, the seed), so a finished warm-start is reused by later runs
with the same settings, and where its demonstrations come from."""

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from primerl.config.env import EnvConfig, MixtureEntry
from primerl.config.model import ModelConfig
from primerl.config.sft import SftConfig, SftLora
from primerl.envs.demonstrations import demonstration_hook, demonstrations_version
from primerl.model.resolve import base_model_ref


class SftSections(Protocol):
    """The sections of the run's config the SFT warm-start reads (`RunConfig` has them, checked by
    tests/test_layering.py): its own settings, the model it starts from, the env whose demonstrations it learns (none
    generated for a mixture), the seed, and the run's name and cache directory that name its result."""

    name: str
    seed: int
    cache_dir: str
    model: ModelConfig
    env: EnvConfig
    mixture: list[MixtureEntry]
    sft: SftConfig


def sft_data_source(cfg: SftSections) -> str | None:
    """Where the warm-start's demonstrations come from: `sft.data` (a chat dataset file or directory), the env's own
    generator (`generated:<env id>`, primerl.envs.demonstrations), or None when there are none for this env (or a
    mixture of envs)."""
    if cfg.sft.data:
        return str(Path(cfg.sft.data).expanduser().resolve())
    if not cfg.mixture and demonstration_hook(cfg.env.id) is not None:
        return f"generated:{cfg.env.id}"
    return None


def sft_trains_lora(cfg: SftSections) -> bool:
    """Whether SFT trains an adapter (`model.lora` on, `sft.lora` adapter or merged) rather than every weight."""
    return cfg.model.lora.enabled and cfg.sft.lora != SftLora.full


def sft_checkpoint_dir(cfg: SftSections) -> Path:
    """Keyed by everything that changes the SFT result, so a finished warm-start is reused by later runs.
    With `sft.data`, its sha256 is part of the key: an edited dataset trains a new checkpoint."""
    settings = asdict(cfg.sft) | {"save_every": None}
    data = settings.pop("data")
    settings.pop("lora")  # in the key only when SFT trains LoRA, so the keys of full SFT stay what they were
    key_parts = [base_model_ref(cfg.model, cfg.cache_dir), settings, cfg.env.id, cfg.env.args, cfg.seed]
    if sft_trains_lora(cfg):
        key_parts.append({"lora": asdict(cfg.model.lora), "sft_lora": cfg.sft.lora.value})
    if data:
        key_parts.append(data_digest(data))
    elif demonstrations_version(cfg.env.id) > 1:  # version 1 is left out: keys made before versions stay valid
        key_parts.append({"demonstrations": demonstrations_version(cfg.env.id)})
    key = json.dumps(key_parts, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(os.path.expanduser(cfg.cache_dir)) / "sft" / f"{cfg.name}-{digest}"


def data_digest(data: str) -> str:
    """sha256 of a dataset file; of a datasets directory, over its files' relative names and bytes in name order."""
    root = Path(data).expanduser()
    if not root.is_dir():
        return hashlib.sha256(root.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()
