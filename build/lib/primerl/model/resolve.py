"""Turn the `model` group into a path or hub id that transformers and vLLM load: `base_model_ref` names it (no side
effect), `prepare_base_model` also builds the tiny model on first use."""

from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.model.config import ModelSource
from primerl.model.tiny import build_tiny_model, tiny_model_dir
from primerl.utils.errors import ConfigError


def base_model_ref(cfg: RunConfig) -> str:
    """Where the model the run starts from, before any SFT, is (or will be, for the tiny model)."""
    model = cfg.model
    if model.source == ModelSource.tiny:
        return str(tiny_model_dir(cfg.cache_dir, model.arch, model.init_seed, model.dtype))
    return prepare_base_model(cfg)


def prepare_base_model(cfg: RunConfig) -> str:
    """The model the run starts from, before any SFT: the tiny model is built here on first use."""
    model = cfg.model
    if model.source == ModelSource.tiny:
        return str(build_tiny_model(cfg.cache_dir, model.arch, model.init_seed, model.dtype))
    if model.source == ModelSource.path:
        if not (Path(model.path) / "config.json").exists():
            raise ConfigError("model.path", f"{model.path} is not a Hugging Face model directory (no config.json)")
        return model.path
    return model.hub_id
