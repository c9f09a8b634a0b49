"""Sequence packing shared by SFT and RL.

Invariants: every row holds exactly `seq_len` tokens; sequences are placed whole (first fit, in order), never
split; `position_ids` restart at 0 at each sequence, which transformers turns into a block-causal mask (pass
`use_cache=False`), so packed sequences never attend to each other; padding takes each field's pad value.
"""

import numpy as np
import torch

PackedRows = dict[str, torch.Tensor]


def _dtype(value: object) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    return torch.long if isinstance(value, int) else torch.float32


NUMPY_DTYPES = {torch.bool: np.bool_, torch.long: np.int64, torch.float32: np.float32}


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
    return _fill_rows(sequences, rows, used, seq_len, pad)


def _concatenate(parts: list, dtype: type) -> np.ndarray:
    """A field's values over the sequences: a list per sequence (one value per token), or an array [tokens, ...]
    (several values per token, e.g. routed experts)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts).astype(dtype, copy=False)
    flat: list = []
    for part in parts:
        flat += part
    return np.array(flat, dtype=dtype)


def _fill_rows(
    sequences: list[dict[str, list]], rows: list[list[int]], used: list[int], seq_len: int, pad: dict[str, object]
) -> PackedRows:
    """Each field in one copy for all rows, through numpy (per row or per sequence, and through `torch.tensor`, the
    copies cost more than the packing: 5% of the orchestrator's CPU at 256 rollouts a batch)."""
    order = [index for members in rows for index in members]
    lengths = [len(sequences[index]["input_ids"]) for index in order]
    # row-major, True where a row holds tokens: the sequences' values in `order` fill it
    filled = torch.arange(seq_len) < torch.tensor(used, dtype=torch.long)[:, None]
    out = {}
    for key, value in pad.items():
        parts = [sequences[index][key] for index in order]
        for index, part, n in zip(order, parts, lengths, strict=True):
            if len(part) != n:
                raise ValueError(f"sequence {index}: {key} has {len(part)} values for {n} tokens")
        values = _concatenate(parts, NUMPY_DTYPES[_dtype(value)])
        out[key] = torch.full((len(rows), seq_len, *values.shape[1:]), value, dtype=_dtype(value))
        out[key][filled] = torch.from_numpy(values)
    # positions restart at each sequence; each row's padding is one more, fully masked segment
    segments, first = [], 0
    for r, members in enumerate(rows):
        segments += lengths[first : first + len(members)] + [seq_len - used[r]]
        first += len(members)
    segments = torch.tensor(segments, dtype=torch.long)
    starts = torch.cumsum(segments, 0) - segments
    flat = torch.arange(len(rows) * seq_len) - torch.repeat_interleave(starts, segments)
    out["position_ids"] = flat.view(len(rows), seq_len)
    return out
