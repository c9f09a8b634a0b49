"""SFT examples for chat tasks: assistant-only loss masks, packed with primerl.trainer.packing.

`labels` are IGNORE (-100) except on assistant tokens; the loss shifts them by one.
"""

from dataclasses import dataclass

import torch

from primerl.transport.packing import pack_sequences

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[bool]  # True on the tokens the model must learn to produce


def chat_example(tokenizer, prompt: list[dict[str, str]], answer: str) -> Example:
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": answer}], tokenize=False
    ).removesuffix("\n")
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    full_ids = tokenizer.encode(full_text, add_special_tokens=False)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError("chat template does not extend the prompt with the answer; cannot mask the prompt")
    return Example(full_ids, [False] * len(prompt_ids) + [True] * (len(full_ids) - len(prompt_ids)))


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
