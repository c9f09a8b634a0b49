"""A fingerprint of a policy's weights: what the trainer published, and what each inference worker serves.

Per tensor, a 16-byte blake2b of its name, dtype, shape and a strided sample of at most `SAMPLE` elements (every
element of a tensor up to that size); the fingerprint is the blake2b of the per-tensor digests in name order, so
the order tensors travel in does not matter. A sample of 4096 elements costs ~0.1 ms per tensor and catches a
version that did not arrive, a tensor sent from another step, or a bucket torn in transit, though not a change
confined to elements between samples (an update moves every element, so a stale tensor differs everywhere).

The trainer fingerprints the tensors it exports (checkpoint layout: per-expert tensors, no tied head). A worker
fingerprints the tensors it loads, but for each tensor its model still holds in that layout after the load (same
name, shape and dtype: the norms, the embedding on one rank), it takes the model's own values: a worker that
received a version but kept serving the old one is caught by every norm of every layer.
"""

import hashlib
import math

import torch

SAMPLE = 4096


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    stride = max(1, math.ceil(flat.numel() / SAMPLE))
    sample = flat[::stride].contiguous().cpu()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}".encode())
    digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.digest()


class Fingerprint:
    """Digests added tensor by tensor (`add`), one hex string at the end (`hexdigest`)."""

    def __init__(self) -> None:
        self.digests: dict[str, bytes] = {}
        self.layouts: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.digests[name] = tensor_digest(name, tensor)
        self.layouts[name] = (tensor.shape, tensor.dtype)

    def hexdigest(self) -> str:
        total = hashlib.blake2b(digest_size=16)
        for name in sorted(self.digests):
            total.update(self.digests[name])
        return total.hexdigest()


def fingerprint_of(tensors: dict[str, torch.Tensor]) -> str:
    fingerprint = Fingerprint()
    for name, tensor in tensors.items():
        fingerprint.add(name, tensor)
    return fingerprint.hexdigest()


def as_metric(fingerprint: str) -> float:
    """The fingerprint's first 48 bits as a number (exact in a float64 metrics row)."""
    return float(int(fingerprint[:12], 16))
