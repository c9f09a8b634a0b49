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
    for r, members in enumerate(rows):  # one tensor per field and row: per sequence, the small copies cost more
        lengths = [len(sequences[index]["input_ids"]) for index in members]
        for key in pad:
            values = []
            for index, n in zip(members, lengths, strict=True):
                if len(sequences[index][key]) != n:
                    raise ValueError(f"sequence {index}: {key} has {len(sequences[index][key])} values for {n} tokens")
                values += sequences[index][key]
            out[key][r, : used[r]] = torch.tensor(values, dtype=out[key].dtype)
        # positions restart at each sequence; the padding is one more, fully masked segment
        positions = [p for n in [*lengths, seq_len - used[r]] for p in range(n)]
        out["position_ids"][r] = torch.tensor(positions)
    return out
