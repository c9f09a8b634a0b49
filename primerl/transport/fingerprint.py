"""A fingerprint of a policy's weights: what the trainer published, and what each inference worker serves.

Per tensor, a sha256 (first 16 bytes) of its name, dtype, shape and every byte of its values; the fingerprint is the
sha256 of the per-tensor digests in name order, so the order tensors travel in does not matter. Every element counts: a
version that did not arrive, a tensor from another step, a bucket torn or altered in transit, or a change confined to
a few elements all give another fingerprint (sha256 is collision-resistant, so a sender cannot make other bytes match
the trainer's digest). The trainer's digest is written into the version's directory under the run's private weights
directory, which no other user can write: the proof needs no key.

The trainer fingerprints the tensors it exports (checkpoint layout: per-expert tensors, no tied head; a LoRA adapter's
own tensors). A worker fingerprints the tensors it loads, and for each one its model still holds in that layout after
the load (same name, shape and dtype: the norms, the embedding on one rank) it takes the model's own values, so a
worker that received a version but kept serving the old one is caught by every norm of every layer. Tensors vLLM
fuses or repacks on load (projections, experts) are proven as received, byte for byte (docs/scaling.md, "Proof of
arrival"). sha256, not blake2b: with the CPU's SHA instructions it runs ~2x faster here (benchmarks/results.md).
"""

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

# Digests run on threads beside whatever produced the tensor (a write, a receive, a reload): hashlib releases the GIL
# on large buffers. The tensors being digested are held until done: at most IN_FLIGHT_BYTES of them per fingerprint,
# so a worker never keeps a second copy of the model alive.
DIGEST_THREADS = max(2, min(8, os.cpu_count() or 2))
IN_FLIGHT_BYTES = 256 << 20
FINGERPRINT_BYTES = 16  # a fingerprint is the first 16 bytes of a sha256: 32 hex digits
_pool: tuple[int, ThreadPoolExecutor] | None = None  # with the pid that made it: a forked child makes its own


def _digests() -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="primerl-digest"))
    return _pool[1]


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    data = tensor.detach().contiguous().cpu().reshape(-1)
    digest = hashlib.sha256()
    digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}".encode())
    digest.update(memoryview(data.view(torch.uint8).numpy()))
    return digest.digest()[:16]


class Fingerprint:
    """Digests added tensor by tensor (`add`, digested on threads), one hex string at the end (`hexdigest`)."""

    def __init__(self) -> None:
        self.digests: dict[str, bytes | Future] = {}
        self.layouts: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._in_flight: deque[tuple[Future, int]] = deque()
        self._in_flight_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        while self._in_flight and self._in_flight_bytes + size > IN_FLIGHT_BYTES:
            done, done_size = self._in_flight.popleft()
            done.result()
            self._in_flight_bytes -= done_size
        future = _digests().submit(tensor_digest, name, tensor)
        self._in_flight.append((future, size))
        self._in_flight_bytes += size
        self.digests[name] = future
        self.layouts[name] = (tensor.shape, tensor.dtype)

    def hexdigest(self) -> str:
        total = hashlib.sha256()
        for name in sorted(self.digests):
            digest = self.digests[name]
            total.update(digest.result() if isinstance(digest, Future) else digest)
        self._in_flight.clear()
        self._in_flight_bytes = 0
        return total.hexdigest()[: 2 * FINGERPRINT_BYTES]


def fingerprint_of(tensors: dict[str, torch.Tensor]) -> str:
    fingerprint = Fingerprint()
    for name, tensor in tensors.items():
        fingerprint.add(name, tensor)
    return fingerprint.hexdigest()


def as_metric(fingerprint: str) -> float:
    """The fingerprint's first 48 bits as a number (exact in a float64 metrics row)."""
    return float(int(fingerprint[:12], 16))
