"""SFT examples for chat tasks: assistant-only loss masks, packed with primerl.transport.packing; chat datasets.

`labels` are IGNORE (-100) except on assistant tokens; the loss shifts them by one.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from primerl.transport.packing import pack_sequences
from primerl.utils.errors import ConfigError

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]  # True on the tokens the model must learn to produce


@dataclass
class Conversation:
    """One SFT conversation: OpenAI-style messages (assistant tool calls in `tool_calls`, results as `tool` messages)
    and the tools offered to the model, rendered by the chat template as in rollouts."""

    messages: list[dict]
    tools: list[dict] | None = None


def chat_example(tokenizer, prompt: list[dict[str, str]], answer: str) -> Example:
    return conversation_example(tokenizer, prompt + [{"role": "assistant", "content": answer}])


def conversation_example(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Example:
    """The conversation up to its last assistant message, with the loss on every assistant message (each one's
    tokens after its generation prompt, through its end-of-turn token); tool results are prompt, never loss."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")

    def ids(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return tokenizer.encode(text if generation_prompt else text.removesuffix("\n"), add_special_tokens=False)

    full_ids = ids(last + 1, False)
    loss_mask = [False] * len(full_ids)
    for i in (i for i, m in enumerate(messages[: last + 1]) if m["role"] == "assistant"):
        start, through = ids(i, True), ids(i + 1, False)
        if full_ids[: len(start)] != start or full_ids[: len(through)] != through:
            raise ValueError(f"chat template does not extend message {i} with its reply; cannot mask the prompt")
        loss_mask[len(start) : len(through)] = [True] * (len(through) - len(start))
    return Example(full_ids, loss_mask)


def load_conversations(path: str) -> list[Conversation]:
    """A chat dataset for `sft.data`: a JSONL file, one {"messages": [...], "tools": [...]} per line (`tools`
    optional), or a Hugging Face `datasets` directory (`save_to_disk`; a DatasetDict's "train" split) with a `messages`
    column. Each conversation needs an assistant message. Any bad row is a ConfigError naming `sft.data`, the row and
    what is wrong."""
    conversations = [_conversation(where, row) for where, row in _rows(path)]
    if not conversations:
        raise ConfigError("sft.data", f"{path} holds no conversations")
    return conversations


def _rows(path: str) -> Iterator[tuple[str, object]]:
    """(where, row) for each row of the dataset at `path`; `where` names the row in errors."""
    file = Path(path).expanduser()
    if file.is_dir():
        for index, row in enumerate(_dataset_dir(path, file)):
            yield f"{path} row {index}", row
        return
    if not file.is_file():
        raise ConfigError("sft.data", f"{path} is neither a JSONL file nor a datasets directory")
    with file.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError("sft.data", f"{path} line {number} is not JSON ({err.msg})") from None
            yield f"{path} line {number}", row


def _dataset_dir(path: str, directory: Path):
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "sft.data", f"{path} is a directory: reading a datasets directory needs `pip install datasets`"
        ) from None
    try:
        dataset = datasets.load_from_disk(str(directory))
    except FileNotFoundError:
        raise ConfigError("sft.data", f"{path} is not a datasets directory (written by save_to_disk)") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError("sft.data", f"{path} has splits {sorted(dataset)} and no 'train' split")
        dataset = dataset["train"]
    if "messages" not in dataset.column_names:
        raise ConfigError("sft.data", f"{path} has no 'messages' column (columns: {dataset.column_names})")
    return dataset


def _conversation(where: str, row: object) -> Conversation:
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ConfigError("sft.data", f"{where} has no 'messages' list")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError("sft.data", f"{where}: every message needs a string 'role' and 'content'")
        if not isinstance(m.get("tool_calls") or [], list):
            raise ConfigError("sft.data", f"{where}: 'tool_calls' must be a list")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError("sft.data", f"{where} has no assistant message to learn")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ConfigError("sft.data", f"{where}: 'tools' must be a list of tool schemas")
    kept = ("role", "content", "tool_calls", "tool_call_id")
    return Conversation([{k: m[k] for k in kept if m.get(k) is not None} for m in messages], tools or None)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [rows, seq_len]
    position_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())


def pack(examples: list[Example], seq_len: int, pad_id: int) -> PackedBatch:
    """Pack examples into rows of `seq_len` (see primerl.trainer.packing); raises if one example is too long."""
    sequences = [
        {"input_ids": ex.input_ids, "labels": [t if m else IGNORE for t, m in zip(ex.input_ids, ex.loss_mask)]}
        for ex in examples
    ]
    rows = pack_sequences(sequences, seq_len, pad={"input_ids": pad_id, "labels": IGNORE})
    return PackedBatch(rows["input_ids"], rows["position_ids"], rows["labels"])
