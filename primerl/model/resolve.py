"""Turn the `model` group into a path or hub id that transformers and vLLM load."""

from pathlib import Path

from primerl.config.schema import RunConfig
from primerl.model.config import ModelSource
from primerl.model.tiny import build_tiny_model
from primerl.utils.errors import ConfigError


def base_model_path(cfg: RunConfig) -> str:
    """The model the run starts from, before any SFT."""
    model = cfg.model
    if model.source == ModelSource.tiny:
        return str(build_tiny_model(cfg.cache_dir, model.arch, model.init_seed, model.dtype))
    if model.source == ModelSource.path:
        if not (Path(model.path) / "config.json").exists():
            raise ConfigError("model.path", f"{model.path} is not a Hugging Face model directory (no config.json)")
        return model.path
    return model.hub_id
