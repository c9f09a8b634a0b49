"""What a model directory must hold: a causal LM (config.json whose `architectures` names a `...ForCausalLM`) and a
tokenizer with a chat template (rollouts are chats). Anything else is a one-line ConfigError naming the key, before
any process starts. JSON only: the config check imports no torch."""

import json
from pathlib import Path

from primerl.utils.errors import ConfigError


def check_model_dir(directory: Path, key: str) -> None:
    """A causal LM with a chat-templated tokenizer in `directory`, or a ConfigError naming `key`."""
    config_file = directory / "config.json"
    if not config_file.exists():
        raise ConfigError(key, f"{directory} is not a Hugging Face model directory (no config.json)")
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except ValueError:
        raise ConfigError(key, f"{config_file} is not JSON") from None
    if not any(name.endswith("ForCausalLM") for name in architectures):
        raise ConfigError(key, f"{directory} is not a causal LM (architectures: {architectures or 'none'})")
    tokenizer_config = directory / "tokenizer_config.json"
    templated = (directory / "chat_template.jinja").exists() or (
        tokenizer_config.exists() and "chat_template" in json.loads(tokenizer_config.read_text())
    )
    if not templated:
        raise ConfigError(key, f"{directory} has no tokenizer with a chat template (rollouts are chats)")
