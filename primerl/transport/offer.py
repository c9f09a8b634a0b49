"""What a collective offer announces (primerl.transport.collective): the tensors of one version, in the order the
trainer sends them, cut into buckets of one dtype, and where to join.

Both sides cut by the same list: the trainer's ranks gather the parameters in that order (`in_buckets` checks it),
and each worker unpacks a received bucket by it. The offer is written as JSON into the version's STABLE directory
(`publish_offer`), so it is the announcement the filesystem transport's weights are.
"""

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from primerl.transport.atomic import atomic_dir, write_json
from primerl.transport.weights import OFFER_FILE, read_json_file


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch's name without the prefix: "bfloat16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive runs of `specs` of one dtype and at most `bucket_bytes` each (a larger tensor is a bucket alone)."""
    buckets: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not buckets or spec.dtype != buckets[-1][0].dtype or size + spec.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += spec.nbytes
    return buckets


@dataclass
class Offer:
    id: str  # unique per offer: an answer names the offer it answers
    version: int
    sender: str  # unique per WeightSender (a restarted trainer is another sender)
    store: str  # the path of the sender's FileStore, below the run's weights directory
    backend: str  # gloo | nccl
    timeout_s: float
    buckets: list[list[TensorSpec]]
    host: str = "127.0.0.1"  # the interface the sender's gloo binds: loopback, or its node's name
    delta: bool = False  # weights.delta: the receivers keep what they proved, to rebuild the next version from it
    base: str = ""  # with delta: the fingerprint of the version a delta is offered against ("": whole buckets only)
    relay: bool = False  # weights.relay: the replicas pass each bucket on (primerl.transport.relay)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Offer":
        buckets = [[TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in bucket] for bucket in data["buckets"]]
        return cls(**{**data, "buckets": buckets})


def publish_offer(version_dir: Path, offer: Offer) -> None:
    """Announce `offer`: its version's directory, STABLE, holding the offer alone."""
    with atomic_dir(version_dir) as staging:
        write_json(staging / OFFER_FILE, offer.to_json())


def read_offer(version_dir: str | Path) -> Offer:
    return Offer.from_json(read_json_file(Path(version_dir) / OFFER_FILE))


def in_buckets(
    offer: Offer, named: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[int, list[TensorSpec], list[torch.Tensor]]]:
    """`named` (name, tensor), cut into the offer's buckets: (index, specs, tensors) each. Raises when a tensor comes
    in another order than the offer announced, or `named` ends before the offer does."""
    for index, bucket in enumerate(offer.buckets):
        tensors = []
        for spec in bucket:
            name, tensor = next(named, (None, None))
            if name != spec.name:
                found = "nothing more" if name is None else name
                raise RuntimeError(f"v{offer.version}: the trainer had {found} where its offer announced {spec.name}")
            tensors.append(tensor)
        yield index, bucket, tensors
