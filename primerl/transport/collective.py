"""Weights by process group: trainer rank 0 sends each new policy to every inference worker, with no file between.

The protocol, one version at a time (the version's directory is still the announcement: primerl.transport.weights):
1. The trainer writes an `Offer` (OFFER_FILE, STABLE-marked): every tensor it will send, in order, cut into
   `weights.bucket_mb` buckets of one dtype; its `WeightSender`'s rendezvous (a FileStore, below); the backend (gloo
   on CPU, NCCL on GPU: the same code).
2. The orchestrator pauses the replicas that will take it and answers with their groups (RECEIVERS_FILE): one
   process group per replica, trainer rank 0 as rank 0 and the replica's workers after it, named by the replica, its
   workers' process and their join count, so a replica that restarted or failed a transfer joins a fresh group.
3. Both sides join the groups they lack (the trainer drops the groups no longer listed), then the trainer broadcasts
   the buckets one by one into every group at once; each worker unpacks a bucket into named tensors as vLLM's loader
   asks for them. The orchestrator resumes the replicas when their loads return.

One group per replica, not one for all: a replica that dies takes only its own group down, and a new one joins
without the others re-forming theirs. The price is trainer rank 0 sending the bytes once per replica (a tree or
NCCL's broadcast across replicas would send them once); the measured latencies are in benchmarks/results.md.

A join or a bucket that does not complete within `weights.timeout_s` raises `TransferError` on the side that waits,
one line naming the version, the bucket and the group; that group is dropped on both sides.

The rendezvous is a file, not a port: a torch FileStore at `<run>/weights/.rendezvous/<sender id>.store`, in the run's
private weights directory (0700), which the workers of the same user reach on the run's filesystem (shared across
nodes under SLURM; it must support file locks, as NFS and Lustre with flock do). A TCPStore on rank 0 let any local
user list the groups' keys, join a group as rank 0 before the trainer and fill the store's memory; nobody else can
open this file. A worker takes a store only from below its run's weights directory. What arrives is proven before it
is served in any case (primerl.inference.worker_extension).
"""

import datetime
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from primerl.transport.fingerprint import Fingerprint
from primerl.transport.offer import Offer, TensorSpec, in_buckets
from primerl.utils.log import get_logger
from primerl.utils.process import is_loopback

log = get_logger(__name__)


class TransferError(RuntimeError):
    """A collective weight transfer that failed or stalled past `weights.timeout_s`."""


def _options(backend: str, timeout_s: float, host: str):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # on loopback both sides bind 127.0.0.1; across nodes each binds the interface its host name resolves to
    loopback = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if is_loopback(host) else None
    options._devices = [loopback or dist.ProcessGroupGloo.create_default_device()]
    return options


def join_group(
    store: dist.Store, name: str, rank: int, world: int, backend: str, timeout_s: float, host: str
) -> dist.ProcessGroup:
    """This process's member of group `name` (blocks until all `world` members joined, at most `timeout_s`)."""
    prefixed = dist.PrefixStore(f"primerl/{name}", store)
    options = _options(backend, timeout_s, host)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, options)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


class WeightSender:
    """Trainer rank 0's side: the FileStore workers join through (in `store_dir`, the run's private weights
    directory), and one process group per receiving replica. `host`: the interface gloo binds (loopback locally)."""

    def __init__(self, host: str, store_dir: str | Path, backend: str, timeout_s: float):
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.id = uuid.uuid4().hex
        store_dir = Path(store_dir)
        store_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        store_dir.chmod(0o700)
        for old in store_dir.glob("*.store"):  # a sender before this one: its trainer is gone (one per run)
            old.unlink(missing_ok=True)
        self.store_path = store_dir / f"{self.id}.store"
        self.store = dist.FileStore(str(self.store_path), -1)
        self.groups: dict[str, dist.ProcessGroup] = {}

    @property
    def address(self) -> str:
        return str(self.store_path)

    def offer(self, version: int, buckets: list[list[TensorSpec]]) -> Offer:
        return Offer(
            uuid.uuid4().hex, version, self.id, str(self.store_path), self.backend, self.timeout_s, buckets, self.host
        )

    def connect(self, version: int, wanted: dict[str, int]) -> None:
        """Keep exactly the groups in `wanted` (name -> members), joining the new ones side by side. A group whose
        members do not all join is logged and left out of this version."""
        for name in set(self.groups) - set(wanted):
            del self.groups[name]
        joined: dict[str, dist.ProcessGroup] = {}

        def join(name: str) -> None:
            try:
                joined[name] = join_group(self.store, name, 0, wanted[name], self.backend, self.timeout_s, self.host)
            except RuntimeError as err:
                log.warning(
                    f"collective weights v{version}: group {name} did not form on the trainer side within "
                    f"{self.timeout_s:g}s (weights.timeout_s): {_first_line(err)}"
                )

        threads = [threading.Thread(target=join, args=(name,)) for name in wanted if name not in self.groups]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.groups |= joined

    def transfer(self, offer: Offer, groups: dict[str, int], named: Iterator[tuple[str, torch.Tensor]]) -> str:
        """Join `groups` (name -> members), then send the offer's buckets, cut from `named` in the announced order,
        into every group at once. Returns the fingerprint of what it sent (primerl.transport.fingerprint)."""
        self.connect(offer.version, groups)
        fingerprint = Fingerprint()
        for index, specs, tensors in in_buckets(offer, named):
            for spec, tensor in zip(specs, tensors, strict=True):
                fingerprint.add(spec.name, tensor)
            self._send(offer, index, torch.cat([tensor.reshape(-1) for tensor in tensors]))
        return fingerprint.hexdigest()

    def _send(self, offer: Offer, index: int, flat: torch.Tensor) -> None:
        """Broadcast bucket `index` into every group at once; a group that fails is dropped, one line."""
        works = {name: group.broadcast([flat], dist.BroadcastOptions()) for name, group in self.groups.items()}
        for name, work in works.items():
            try:
                work.wait()
            except RuntimeError as err:
                log.warning(
                    f"collective weights v{offer.version}: bucket {index + 1}/{len(offer.buckets)} to group {name} "
                    f"failed on the trainer side ({_first_line(err)}); that replica is left out until it joins again"
                )
                del self.groups[name]


class WeightReceiver:
    """A worker's side: its groups, by the sender they belong to (a restarted trainer's offers need new ones)."""

    def __init__(self) -> None:
        self.nonce = uuid.uuid4().hex[:12]
        self.joins = 0  # counts the groups this worker lost: the next group it joins has a fresh name
        self.groups: dict[tuple[str, str], dist.ProcessGroup] = {}
        self.stores: dict[str, dist.Store] = {}

    @property
    def identity(self) -> str:
        return f"{self.nonce}.{self.joins}"

    def _group(self, offer: Offer, name: str, rank: int, world: int) -> dist.ProcessGroup:
        key = (offer.sender, name)
        if key not in self.groups:
            self.groups = {k: g for k, g in self.groups.items() if k[0] == offer.sender}
            if offer.store not in self.stores:
                self.stores = {offer.store: dist.FileStore(offer.store, -1)}
            try:
                # twice the limit: the trainer may spend one on another replica's group that never forms
                waits = 2 * offer.timeout_s
                self.groups[key] = join_group(
                    self.stores[offer.store], name, rank, world, offer.backend, waits, offer.host
                )
            except RuntimeError as err:
                self.joins += 1
                raise TransferError(
                    f"collective weights v{offer.version}: group {name} did not form on the worker side within "
                    f"{offer.timeout_s:g}s (weights.timeout_s): {_first_line(err)}"
                ) from err
        return self.groups[key]

    def tensors(
        self, offer: Offer, name: str, rank: int, world: int, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The offer's tensors, received bucket by bucket as the caller iterates."""
        group = self._group(offer, name, rank, world)
        for index, bucket in enumerate(offer.buckets):
            flat = torch.empty(sum(s.numel for s in bucket), dtype=getattr(torch, bucket[0].dtype), device=device)
            try:
                group.broadcast([flat], dist.BroadcastOptions()).wait()
            except RuntimeError as err:
                del self.groups[(offer.sender, name)]
                self.joins += 1
                raise TransferError(
                    f"collective weights v{offer.version}: bucket {index + 1}/{len(offer.buckets)} did not arrive "
                    f"on the worker side of group {name} within {2 * offer.timeout_s:g}s (2 x weights.timeout_s): "
                    f"{_first_line(err)}"
                ) from err
            offset = 0
            for spec in bucket:
                yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
                offset += spec.numel
