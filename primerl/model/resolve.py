"""Turn the `model` group into a local directory that transformers and vLLM load: `base_model_ref` names it (no side
effect), `prepare_base_model` also builds the tiny model on first use and fetches a hub model into the local Hugging
Face cache (the driver does, in its preflight; every process it starts then finds the same snapshot there)."""

import os
from pathlib import Path

from primerl.config.model import ModelConfig, ModelSource
from primerl.config.model_dir import check_model_dir
from primerl.model.tiny import build_tiny_model, tiny_model_dir
from primerl.utils.errors import ConfigError


def base_model_ref(model: ModelConfig, cache_dir: str) -> str:
    """Where the model the run starts from, before any SFT, is (or will be, for the tiny model, under `cache_dir`)."""
    if model.source == ModelSource.tiny:
        return str(tiny_model_dir(cache_dir, model.arch, model.init_seed, model.dtype))
    return prepare_base_model(model, cache_dir)


def prepare_base_model(model: ModelConfig, cache_dir: str) -> str:
    """The model the run starts from, before any SFT: the tiny model is built here, under `cache_dir`, on first use."""
    if model.source == ModelSource.tiny:
        return str(build_tiny_model(cache_dir, model.arch, model.init_seed, model.dtype))
    if model.source == ModelSource.path:
        directory = Path(model.path).expanduser()
        check_model_dir(directory, "model.path")
        return str(directory)
    directory = hub_snapshot(model.hub_id)
    check_model_dir(directory, "model.hub_id")
    return str(directory)


def hub_snapshot(hub_id: str) -> Path:
    """The local snapshot of `hub_id`: from the Hugging Face cache, else downloaded when the hub is reachable
    (HF_HUB_OFFLINE unset). Offline and not cached: a ConfigError naming model.hub_id."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(hub_id, local_files_only=True, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise ConfigError(
                "model.hub_id",
                f"{hub_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download it "
                "(huggingface-cli download) or give a directory (model=hf model.path=DIR)",
            ) from None
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except (HfHubHTTPError, OSError, ValueError) as err:
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ConfigError("model.hub_id", f"{hub_id} is not cached and could not be downloaded ({why})") from None
