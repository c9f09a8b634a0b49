"""Weights by process group: trainer rank 0 sends each new policy to every inference worker, with no file between.

The protocol, one version at a time (the version's directory is still the announcement: primerl.transport.weights):
1. The trainer writes an `Offer` (OFFER_FILE, STABLE-marked): every tensor it will send, in order, cut into
   `weights.bucket_mb` buckets of one dtype; where its `WeightSender` listens (a TCPStore on trainer rank 0); the
   backend (gloo on CPU, NCCL on GPU: the same code).
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
"""

import datetime
import socket
import threading
import uuid
from collections.abc import Iterator

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
    """Trainer rank 0's side: the TCPStore workers join through, and one process group per receiving replica."""

    def __init__(self, host: str, port: int, backend: str, timeout_s: float):
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        # bound by us to `host` alone (torch's own store would listen on every interface)
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.store = dist.TCPStore(
            host,
            self._listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=self._listener.fileno(),
        )
        self.id = uuid.uuid4().hex
        self.groups: dict[str, dist.ProcessGroup] = {}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.store.port}"

    def offer(self, version: int, buckets: list[list[TensorSpec]]) -> Offer:
        return Offer(uuid.uuid4().hex, version, self.id, self.address, self.backend, self.timeout_s, buckets)

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
            host, port = offer.store.rsplit(":", 1)
            if offer.store not in self.stores:
                timeout = datetime.timedelta(seconds=offer.timeout_s)
                self.stores = {offer.store: dist.TCPStore(host, int(port), is_master=False, timeout=timeout)}
            try:
                # twice the limit: the trainer may spend one on another replica's group that never forms
                waits = 2 * offer.timeout_s
                self.groups[key] = join_group(self.stores[offer.store], name, rank, world, offer.backend, waits, host)
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
