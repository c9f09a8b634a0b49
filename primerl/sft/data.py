"""SFT examples for chat tasks: assistant-only loss masks and sequence packing.

Invariants of `pack`: every row has exactly `seq_len` tokens; `position_ids` restart at 0 at each packed sample
(transformers turns that into a block-causal mask, so samples never attend to each other); `labels` are -100
except on assistant tokens, shifted by the model; no sample is split across rows.
"""

from dataclasses import dataclass

import torch

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
    """Greedy first-fit packing in order; raises if one example is longer than a row."""
    rows: list[list[Example]] = []
    lengths: list[int] = []
    for ex in examples:
        if len(ex.input_ids) > seq_len:
            raise ValueError(f"example of {len(ex.input_ids)} tokens does not fit seq_len={seq_len}")
        for i, used in enumerate(lengths):
            if used + len(ex.input_ids) <= seq_len:
                rows[i].append(ex)
                lengths[i] += len(ex.input_ids)
                break
        else:
            rows.append([ex])
            lengths.append(len(ex.input_ids))
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), seq_len), dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for ex in row:
            n = len(ex.input_ids)
            ids[r, start : start + n] = torch.tensor(ex.input_ids)
            pos[r, start : start + n] = torch.arange(n)
            masked = [t if m else IGNORE for t, m in zip(ex.input_ids, ex.loss_mask)]
            labels[r, start : start + n] = torch.tensor(masked)
            start += n
        # padding continues positions so it forms one more (ignored) segment
        pos[r, start:] = torch.arange(seq_len - start)
    return PackedBatch(ids, pos, labels)
