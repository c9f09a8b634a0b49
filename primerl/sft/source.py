"""Where SFT's conversations come from: a user's chat dataset (`sft.data`), or the env's own generator."""

import random
from collections.abc import Iterator

from primerl.envs.demonstrations import generate
from primerl.model.resolve import prepare_base_model
from primerl.sft.cache import SftSections, sft_checkpoint_dir, sft_data_source
from primerl.sft.data import Conversation, conversation_example, load_conversations
from primerl.transport.atomic import is_stable
from primerl.utils.errors import ConfigError


def check_demonstrations(cfg: SftSections) -> None:
    """A one-line ConfigError when SFT has nothing to learn from: no generator for the env and no `sft.data`, a bad
    dataset row, or options the generator refuses. Called before any process or rank starts."""
    if cfg.sft.data:
        conversations = load_conversations(cfg.sft.data)
        where = [f"{cfg.sft.data} conversation {i}" for i in range(len(conversations))]
    elif sft_data_source(cfg) is None:
        raise ConfigError(
            "sft.data",
            f"no demonstrations for env.id={cfg.env.id}: give a chat dataset "
            "(sft.data=FILE.jsonl), or give the env's package a `demonstrations` hook",
        )
    else:
        conversations = generated_conversations(cfg, cfg.sft.batch_size)
        where = [f"generated demonstration {i} of env {cfg.env.id}" for i in range(len(conversations))]
    if not is_stable(sft_checkpoint_dir(cfg)):
        check_lengths(cfg, conversations, where)


def check_lengths(cfg: SftSections, conversations: list[Conversation], where: list[str]) -> None:
    """Each conversation, rendered by the base model's chat template, fits one packed row of `sft.seq_len` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_base_model(cfg.model, cfg.cache_dir))
    for conversation, name in zip(conversations, where):
        try:
            tokens = len(conversation_example(tokenizer, conversation.messages, conversation.tools).input_ids)
        except ValueError as err:
            raise ConfigError("sft.data", f"{name}: {err}") from None
        if tokens > cfg.sft.seq_len:
            raise ConfigError(
                "sft.seq_len", f"{name} is {tokens} tokens, more than sft.seq_len={cfg.sft.seq_len}; raise it"
            )


def generated_conversations(cfg: SftSections, count: int) -> list[Conversation]:
    rows = generate(cfg.env.id, count, cfg.seed, cfg.env.args, cfg.sft.demonstration_args)
    return [Conversation(row["messages"], row.get("tools")) for row in rows]


def demonstration_batches(cfg: SftSections) -> Iterator[list[Conversation]]:
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
