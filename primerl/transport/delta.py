"""Only what changed travels (`weights.delta=true`, collective transport): a bucket as the bits that differ from the
version the receiver already serves.

A bucket's delta against its base (the same bucket of the previous version, same tensors, same dtype) is the packed
mask of the positions whose raw bits differ (one bit per value) followed by the new values at those positions, in
order. Raw bits, not values: -0.0 against 0.0 and a NaN's payload count as changes, so the receiver rebuilds the
trainer's bytes exactly. At the 9.5-10% of bf16 values that change per RL step here (benchmarks/results.md) a delta
is 0.125 + 0.1 x 2 bytes per value against 2: ~6x less. Where it would not be smaller than the bucket itself the
bucket goes whole (`encode` returns None).

Which version a receiver holds is its `Base`: the flat buckets of the last version it proved, with that version's
fingerprint. The sender keeps its own (the last version it sent) and offers a delta against it (Offer.base); each
replica group answers with its base's fingerprint before the first bucket (primerl.transport.collective), and takes a
delta only when the two match, whole buckets otherwise. The load is proven afterwards as any other
(primerl.transport.fingerprint): a rebuilt version is bit-exact, or the load is refused.
"""

from dataclasses import dataclass

import numpy as np
import torch

from primerl.transport.offer import TensorSpec

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHIFTS = torch.arange(8, dtype=torch.uint8)
WHOLE = -1  # the header of a bucket that goes whole to a group that takes deltas


@dataclass
class Base:
    """The version a side can build deltas from: its fingerprint, its bucket plan, and its buckets flat (CPU)."""

    fingerprint: str
    plan: list[list[TensorSpec]]
    buckets: list[torch.Tensor]

    def serves(self, plan: list[list[TensorSpec]]) -> bool:
        return self.plan == plan and len(self.buckets) == len(plan)


def _raw(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_BITS[flat.element_size()])


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, 8 positions per byte, lowest bit first (numpy's packbits, little bit order: the CPU
    path's, so both sides agree whatever their devices)."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).view(-1)[:numel].bool()


def delta_bytes(numel: int, element_size: int, changed: int) -> int:
    return -(-numel // 8) + changed * element_size


def encode(flat: torch.Tensor, base: torch.Tensor, by_numpy: bool | None = None) -> tuple[int, torch.Tensor] | None:
    """(how many values changed, the delta as bytes), or None when the delta would not be smaller than `flat`.
    `by_numpy`: numpy's packbits and indexing (CPU tensors only; 1.5x torch's encode rate here idle, 2.3x beside a
    busy core) or torch's ops (any device; on CPU for tests); by default numpy on CPU. Both give the same bytes."""
    if base.shape != flat.shape or base.dtype != flat.dtype:
        raise ValueError(f"a delta needs a base of the same layout: {base.dtype}{list(base.shape)} for {flat.dtype}")
    by_numpy = flat.device.type == "cpu" if by_numpy is None else by_numpy
    if by_numpy:
        new, old = _raw(flat).numpy(), _raw(base).numpy()
        mask = new != old
        values = torch.from_numpy(new[mask].view(np.uint8))
    else:
        new = _raw(flat)
        mask = new != _raw(base.to(flat.device))
        values = new[mask].view(torch.uint8)
    changed = values.numel() // flat.element_size()
    if delta_bytes(flat.numel(), flat.element_size(), changed) >= flat.numel() * flat.element_size():
        return None
    packed = torch.from_numpy(np.packbits(mask, bitorder="little")) if by_numpy else pack_bits(mask)
    return changed, torch.cat([packed, values])


def decode(base: torch.Tensor, changed: int, payload: torch.Tensor, by_numpy: bool | None = None) -> torch.Tensor:
    """The new flat bucket: `base` (its dtype and size) with the delta `payload` of `changed` values applied, on the
    payload's device. `by_numpy`: as for `encode`."""
    mask_bytes = -(-base.numel() // 8)
    if payload.numel() != delta_bytes(base.numel(), base.element_size(), changed):
        raise ValueError(f"a delta of {changed} values over {base.numel()} cannot be {payload.numel()} bytes")
    by_numpy = payload.device.type == "cpu" if by_numpy is None else by_numpy
    flat = base.to(payload.device, copy=True)
    raw = _raw(flat)
    values = payload[mask_bytes:].clone().view(raw.dtype)  # cloned: a view of another dtype must start aligned
    if by_numpy:
        positions = np.flatnonzero(np.unpackbits(payload[:mask_bytes].numpy(), count=base.numel(), bitorder="little"))
    else:
        positions = unpack_bits(payload[:mask_bytes], base.numel()).nonzero().squeeze(1)
    if len(positions) != changed:
        raise ValueError(f"a delta's mask marks {len(positions)} values where its header says {changed}")
    if by_numpy:
        raw.numpy()[positions] = values.numpy()
    else:
        raw[positions] = values
    return flat
