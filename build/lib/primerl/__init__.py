"""primerl: asynchronous RL for LLM agents (orchestrator / trainer / inference), configured with Hydra."""

__version__ = "0.1.0"
