"""The one exception for a config value that cannot work. A leaf module: raising it imports nothing else."""


class ConfigError(ValueError):
    """A config value that cannot work; `key` is the dotted path a user would override."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message
