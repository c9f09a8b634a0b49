"""Which weights a run starts from: the SFT warm-start checkpoint (cached, keyed by what changes it) or the base model.

Every process asks this module, so inference serves, the orchestrator tokenizes for and the trainer trains the same
start weights. Whether SFT applies is a pure function of the config (`sft_applies`), decided identically in the
driver, before any process starts, and in every process it starts.

With LoRA (`model.lora.rank` > 0) a run starts from a model plus its start adapter, policy version 0, at
`weights_path(run, 0)`. By `sft.lora` when SFT applies: `adapter`, the base model and the adapter SFT trained;
`merged`, the SFT model (its adapter merged in) and a seeded start adapter (primerl.model.adapter); `full`, the SFT
model trained without LoRA and a seeded start adapter. Without SFT: the base model and a seeded start adapter.
Version 0 is never dropped, so a restarted server can always be started with it.
"""

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.envs.demonstrations import demonstration_hook, demonstrations_version
from primerl.model.resolve import base_model_ref, prepare_base_model
from primerl.sft.config import SftLora
from primerl.transport.atomic import STABLE_MARKER, atomic_dir, is_stable
from primerl.transport.run_dir import weights_path
from primerl.utils.errors import ConfigError


def sft_data_source(cfg: RunConfig) -> str | None:
    """Where the warm-start's demonstrations come from: `sft.data` (a chat dataset file or directory), the env's own
    generator (`generated:<env id>`, primerl.envs.demonstrations), or None when there are none for this env (or a
    mixture of envs)."""
    if cfg.sft.data:
        return str(Path(cfg.sft.data).expanduser().resolve())
    if not cfg.mixture and demonstration_hook(cfg.env.id) is not None:
        return f"generated:{cfg.env.id}"
    return None


def sft_applies(cfg: RunConfig) -> bool:
    """SFT runs (or its cached checkpoint is used) only when enabled and there are demonstrations for it."""
    return cfg.sft.enabled and sft_data_source(cfg) is not None


def sft_trains_lora(cfg: RunConfig) -> bool:
    """Whether SFT trains an adapter (`model.lora` on, `sft.lora` adapter or merged) rather than every weight."""
    return cfg.model.lora.enabled and cfg.sft.lora != SftLora.full


def rl_continues_sft_adapter(cfg: RunConfig) -> bool:
    return sft_applies(cfg) and cfg.model.lora.enabled and cfg.sft.lora == SftLora.adapter


def sft_checkpoint_dir(cfg: RunConfig) -> Path:
    """Keyed by everything that changes the SFT result, so a finished warm-start is reused by later runs.
    With `sft.data`, its sha256 is part of the key: an edited dataset trains a new checkpoint."""
    settings = asdict(cfg.sft) | {"save_every": None}
    data = settings.pop("data")
    settings.pop("lora")  # in the key only when SFT trains LoRA, so the keys of full SFT stay what they were
    key_parts = [base_model_ref(cfg), settings, cfg.env.id, cfg.env.args, cfg.seed]
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


def prepare_start_model(cfg: RunConfig) -> str:
    """The model RL starts from: the SFT checkpoint when SFT applies (trained before, by primerl.sft), else the base
    model (the tiny model built here on first use); the base model when RL continues SFT's adapter."""
    if sft_applies(cfg) and not rl_continues_sft_adapter(cfg):
        return str(sft_checkpoint_dir(cfg))
    return prepare_base_model(cfg)


def prepare_start_adapter(cfg: RunConfig) -> Path | None:
    """With LoRA, the run's policy version 0 (module docstring), written on first use; None without LoRA."""
    if not cfg.model.lora.enabled:
        return None
    target = weights_path(cfg.output_dir, 0)
    if is_stable(target):
        return target
    if not rl_continues_sft_adapter(cfg):
        from primerl.model.adapter import write_start_adapter  # torch, transformers: only LoRA runs pay the import

        return write_start_adapter(prepare_start_model(cfg), cfg.model.lora, cfg.seed, target)
    trained = sft_checkpoint_dir(cfg)
    if not is_stable(trained):
        raise ConfigError(
            "sft.enabled",
            f"the SFT adapter {trained} does not exist yet; run `python -m primerl.sft` with the same "
            "config first, or set sft.enabled=false",
        )
    with atomic_dir(target, replace=False) as staging:  # the SFT adapter, copied: the run owns its version 0
        for file in trained.iterdir():
            if file.is_file() and file.name != STABLE_MARKER:
                shutil.copy2(file, staging / file.name)
    return target
