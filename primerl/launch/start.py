"""Which weights a run starts from: the SFT warm-start checkpoint (cached, keyed by what changes it) or the base model.

Every process asks this module, so inference serves, the orchestrator tokenizes for and the trainer trains the same
start weights. Whether SFT applies is a pure function of the config (`sft_applies`), decided identically in the
driver, before any process starts, and in every process it starts. Deciding imports the env's package (its
demonstrations hook and version: primerl.envs.demonstrations), which imports verifiers: ~5 s on 2 cores, in front of
the inference server's start. So the driver writes its decision into the run directory (`record_start_model`, keyed
by the config sections it depends on), and a process of that run with the same sections reads it back instead.

With LoRA (`model.lora.rank` > 0) a run starts from a model plus its start adapter, policy version 0, at
`weights_path(run, 0)`. By `sft.lora` when SFT applies: `adapter`, the base model and the adapter SFT trained;
`merged`, the SFT model (its adapter merged in) and a seeded start adapter (primerl.model.adapter); `full`, the SFT
model trained without LoRA and a seeded start adapter. Without SFT: the base model and a seeded start adapter.
Version 0 is never dropped, so a restarted server can always be started with it.
"""

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.config.sft import SftLora
from primerl.model.resolve import prepare_base_model
from primerl.sft.cache import sft_checkpoint_dir, sft_data_source
from primerl.transport.atomic import STABLE_MARKER, atomic_dir, is_stable, write_json
from primerl.transport.run_dir import start_model_path, weights_path
from primerl.transport.weights import read_json_file
from primerl.utils.errors import ConfigError


def sft_applies(cfg: RunConfig) -> bool:
    """SFT runs (or its cached checkpoint is used) only when enabled and there are demonstrations for it."""
    return cfg.sft.enabled and sft_data_source(cfg) is not None


def rl_continues_sft_adapter(cfg: RunConfig) -> bool:
    return sft_applies(cfg) and cfg.model.lora.enabled and cfg.sft.lora == SftLora.adapter


def prepare_start_model(cfg: RunConfig) -> str:
    """The model RL starts from: the SFT checkpoint when SFT applies (trained before, by primerl.sft), else the base
    model (the tiny model built here on first use); the base model when RL continues SFT's adapter. What the driver
    recorded for this run, when it was decided on the same config sections."""
    recorded = read_json_file(start_model_path(cfg.output_dir))
    if recorded is not None and recorded.get("inputs") == _start_inputs(cfg):
        return recorded["model"]
    return decide_start_model(cfg)


def record_start_model(cfg: RunConfig) -> str:
    """Decide the start model in the driver, before it starts the run's processes, and write the decision where they
    find it (module docstring)."""
    model = decide_start_model(cfg)
    write_json(start_model_path(cfg.output_dir), {"inputs": _start_inputs(cfg), "model": model})
    return model


def decide_start_model(cfg: RunConfig) -> str:
    """`prepare_start_model` from the config alone, never from a recorded decision."""
    if sft_applies(cfg) and not rl_continues_sft_adapter(cfg):
        return str(sft_checkpoint_dir(cfg))
    return prepare_base_model(cfg.model, cfg.cache_dir)


def _start_inputs(cfg: RunConfig) -> str:
    """A digest of the config sections the start model depends on (the env package's demonstrations version aside,
    which a process started by the same driver reads from the same installed package)."""
    parts = [asdict(cfg.sft), asdict(cfg.model), asdict(cfg.env), [asdict(m) for m in cfg.mixture], cfg.seed]
    return hashlib.sha256(json.dumps([*parts, cfg.cache_dir], sort_keys=True, default=str).encode()).hexdigest()


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
            f"the SFT adapter {trained} does not exist yet; run `primerl sft` with the same "
            "config first, or set sft.enabled=false",
        )
    with atomic_dir(target, replace=False) as staging:  # the SFT adapter, copied: the run owns its version 0
        for file in trained.iterdir():
            if file.is_file() and file.name != STABLE_MARKER:
                shutil.copy2(file, staging / file.name)
    return target
