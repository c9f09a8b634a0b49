"""Where SFT's conversations come from: a user's chat dataset (`sft.data`), or the env's own generator."""

import random
from collections.abc import Iterator

from primerl.config.schema import RunConfig
from primerl.envs.demonstrations import generate
from primerl.model.start import sft_data_source
from primerl.sft.data import Conversation, load_conversations
from primerl.utils.errors import ConfigError


def check_demonstrations(cfg: RunConfig) -> None:
    """A one-line ConfigError when SFT has nothing to learn from: no generator for the env and no `sft.data`, a bad
    dataset row, or options the generator refuses. Called before any process or rank starts."""
    if cfg.sft.data:
        load_conversations(cfg.sft.data)
    elif sft_data_source(cfg) is None:
        raise ConfigError(
            "sft.data",
            f"no demonstrations for env.id={cfg.env.id}: give a chat dataset "
            "(sft.data=FILE.jsonl), or give the env's package a `demonstrations` hook",
        )
    else:
        generated_conversations(cfg, 1)


def generated_conversations(cfg: RunConfig, count: int) -> list[Conversation]:
    rows = generate(cfg.env.id, count, cfg.seed, cfg.env.args, cfg.sft.demonstration_args)
    return [Conversation(row["messages"], row.get("tools")) for row in rows]


def demonstration_batches(cfg: RunConfig) -> Iterator[list[Conversation]]:
    """`sft.steps` batches of `sft.batch_size` conversations: from `sft.data` (every pass reshuffled, seeded), or
    generated for the env (`check_demonstrations` first)."""
    size = cfg.sft.batch_size
    if not cfg.sft.data:
        conversations = generated_conversations(cfg, cfg.sft.steps * size)
        for step in range(cfg.sft.steps):
            yield conversations[step * size : (step + 1) * size]
        return
    data = load_conversations(cfg.sft.data)
    rng, order = random.Random(f"{cfg.seed}/sft-data"), []
    for _ in range(cfg.sft.steps):
        while len(order) < size:
            next_pass = list(range(len(data)))
            rng.shuffle(next_pass)
            order += next_pass
        yield [data[i] for i in order[:size]]
        order = order[size:]
