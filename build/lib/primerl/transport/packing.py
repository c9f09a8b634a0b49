"""Sequence packing shared by SFT and RL.

Invariants: every row holds exactly `seq_len` tokens; sequences are placed whole (first fit, in order), never
split; `position_ids` restart at 0 at each sequence, which transformers turns into a block-causal mask (pass
`use_cache=False`), so packed sequences never attend to each other; padding takes each field's pad value.
"""

import torch

PackedRows = dict[str, torch.Tensor]


def _dtype(value: object) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    return torch.long if isinstance(value, int) else torch.float32


def pack_sequences(sequences: list[dict[str, list]], seq_len: int, pad: dict[str, object]) -> PackedRows:
    """Pack per-token fields (all of one length per sequence) into rows; adds `position_ids`."""
    rows: list[list[int]] = []
    used: list[int] = []
    for index, seq in enumerate(sequences):
        n = len(seq["input_ids"])
        if n > seq_len:
            raise ValueError(f"sequence {index} of {n} tokens does not fit seq_len={seq_len}")
        for r, length in enumerate(used):
            if length + n <= seq_len:
                rows[r].append(index)
                used[r] += n
                break
        else:
            rows.append([index])
            used.append(n)
    out = {key: torch.full((len(rows), seq_len), value, dtype=_dtype(value)) for key, value in pad.items()}
    out["position_ids"] = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for index in members:
            seq = sequences[index]
            n = len(seq["input_ids"])
            for key in pad:
                out[key][r, start : start + n] = torch.tensor(seq[key], dtype=out[key].dtype)
            out["position_ids"][r, start : start + n] = torch.arange(n)
            start += n
        out["position_ids"][r, start:] = torch.arange(seq_len - start)  # padding: one more, fully masked segment
    return out
