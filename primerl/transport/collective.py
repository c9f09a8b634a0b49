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
   asks for them (primerl.transport.receiver). The orchestrator resumes the replicas when their loads return.
With `weights.delta=true` a group whose replica proved the version the offer names as its base gets each bucket as
the values that changed since (primerl.transport.delta); the others, whole buckets.

One group per replica, not one for all: a replica that dies takes only its own group down, and a new one joins
without the others re-forming theirs. The price is trainer rank 0 sending the bytes once per replica, unless
`weights.relay=true`: then the replicas pass each bucket on in a chain and the trainer sends it once
(primerl.transport.relay); the measured costs are in benchmarks/results.md.

A join or a bucket that does not complete within `weights.timeout_s` raises `TransferError` on the side that waits,
one line naming the version, the bucket and the group; that group is dropped on both sides.

The rendezvous is a file, not a port: a torch FileStore at `<run>/weights/.rendezvous/<sender id>.store`, in the run's
private weights directory (0700), which the workers of the same user reach on the run's filesystem (shared across
nodes under SLURM; it must support file locks, as NFS and Lustre with flock do). A TCPStore on rank 0 let any local
user list the groups' keys, join a group as rank 0 before the trainer and fill the store's memory; nobody else can
open this file. A worker takes a store only from below its run's weights directory. What arrives is proven before it
is served in any case (primerl.inference.worker_extension).
"""

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from primerl.transport.delta import WHOLE, Base, encode
from primerl.transport.fingerprint import FINGERPRINT_BYTES, Fingerprint
from primerl.transport.groups import as_hex, first_line, from_rank, join_group, least
from primerl.transport.offer import Offer, TensorSpec, in_buckets
from primerl.transport.relay import Link, chains, links, plan_tensor
from primerl.utils.log import get_logger

log = get_logger(__name__)


class WeightSender:
    """Trainer rank 0's side: the FileStore workers join through (in `store_dir`, the run's private weights
    directory), and one process group per receiving replica. `host`: the interface gloo binds (loopback locally)."""

    def __init__(
        self, host: str, store_dir: str | Path, backend: str, timeout_s: float, delta: bool = False, relay: bool = False
    ):
        """`delta` (weights.delta): keep each version sent, to offer the next as a delta against it. `relay`
        (weights.relay): send each bucket into the first group of each chain only (primerl.transport.relay)."""
        self.host, self.backend, self.timeout_s, self.delta, self.relay = host, backend, timeout_s, delta, relay
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.base: Base | None = None  # the last version sent, with delta
        self.egress: dict[str, int] = {}  # the last transfer's bytes, by group
        self.delta_takers: set[str] = set()  # the last transfer's groups that were sent deltas
        self._chains: list[list[str]] = []  # with relay: the last version's chains, and the version that formed them
        self._epoch = 0
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
        base = self.base.fingerprint if self.base is not None and self.base.serves(buckets) else ""
        return Offer(
            id=uuid.uuid4().hex,
            version=version,
            sender=self.id,
            store=str(self.store_path),
            backend=self.backend,
            timeout_s=self.timeout_s,
            buckets=buckets,
            host=self.host,
            delta=self.delta,
            base=base,
            relay=self.relay,
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
                    f"{self.timeout_s:g}s (weights.timeout_s): {first_line(err)}"
                )

        threads = [threading.Thread(target=join, args=(name,)) for name in wanted if name not in self.groups]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.groups |= joined

    def transfer(self, offer: Offer, groups: dict[str, int], named: Iterator[tuple[str, torch.Tensor]]) -> str:
        """Join `groups` (name -> members), then send the offer's buckets, cut from `named` in the announced order,
        into every group at once, or with relay into the first group of each chain: whole, or as deltas to the groups
        whose replica serves the offer's base (primerl.transport.delta). Returns the fingerprint of what it sent
        (primerl.transport.fingerprint)."""
        self.connect(offer.version, groups)
        takers = self.delta_takers = self._delta_takers(offer) if offer.base else set()
        chained = chains(list(self.groups), takers) if offer.relay else [[name] for name in self.groups]
        if offer.relay:
            if chained != self._chains:  # new members, or a relay broke last time: new relay groups
                self._epoch = offer.version
            self._chains = chained
            self._plan(offer, links(chained, groups, self._epoch))
        self.egress = dict.fromkeys(self.groups, 0)
        fingerprint, kept = Fingerprint(), []
        for index, specs, tensors in in_buckets(offer, named):
            for spec, tensor in zip(specs, tensors, strict=True):
                fingerprint.add(spec.name, tensor)
            flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
            delta = encode(flat, self.base.buckets[index]) if takers & set(self.groups) and self.base else None
            self._send(offer, index, flat, takers, delta, {chain[0] for chain in chained})
            if offer.delta or offer.relay:
                kept.append((flat.cpu(), delta))
        if offer.relay:
            self._repair(offer, takers, kept, [name for chain in chained for name in chain])
        digest = fingerprint.hexdigest()
        if offer.delta:
            self.base = Base(digest, offer.buckets, [flat for flat, _ in kept])
        return digest

    def _plan(self, offer: Offer, planned: dict[str, Link]) -> None:
        """Tell each group its place in its chain, before the first bucket."""
        works = {
            name: group.broadcast([plan_tensor(planned[name], self.device)], from_rank(0))
            for name, group in self.groups.items()
        }
        for name, work in works.items():
            self._wait(offer, name, "the relay plan", work)

    def _repair(self, offer: Offer, takers: set[str], kept: list, order: list[str]) -> None:
        """Every group's status (its members' first missing bucket, MIN); the rest of the version, from the copy
        kept, to each group that lost its relay. In chain order: a group behind a repaired one finishes after it."""
        total = len(offer.buckets)
        missing = {name: torch.tensor([total], dtype=torch.int64, device=self.device) for name in self.groups}
        works = {name: self.groups[name].allreduce([missing[name]], least()) for name in missing}
        for name in order:
            if name not in works or not self._wait(offer, name, "the relay status", works[name]):
                continue
            first = int(missing[name].item())
            if first < total:
                self._chains = []  # that relay group is broken: the next version forms new ones
                log.warning(
                    f"collective weights v{offer.version}: group {name} lost its relay at bucket {first + 1}/{total}; "
                    "the trainer sends it the rest"
                )
            for index in range(first, total):  # the kept copy is in host memory: NCCL sends from the device
                self._send(offer, index, kept[index][0].to(self.device), takers, kept[index][1], {name})

    def _delta_takers(self, offer: Offer) -> set[str]:
        """The groups whose replica serves the offer's base: each group's first worker (rank 1) announces the
        fingerprint of the version it holds, before the first bucket."""
        announced = {
            name: torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8, device=self.device) for name in self.groups
        }
        works = {name: self.groups[name].broadcast([announced[name]], from_rank(1)) for name in announced}
        for name, work in works.items():
            self._wait(offer, name, "the base announcement", work)
        return {name for name in self.groups if as_hex(announced[name]) == offer.base}

    def _send(self, offer: Offer, index: int, flat: torch.Tensor, takers: set[str], delta, to: set[str]) -> None:
        """Broadcast bucket `index` into the groups `to` at once (to the delta takers: a header, then the delta or
        the whole bucket); a group that fails is dropped, one line."""
        header = torch.tensor([WHOLE if delta is None else delta[0]], dtype=torch.int64, device=self.device)
        works = {}
        for name, group in self.groups.items():
            if name not in to:
                continue
            if name not in takers:
                works[name] = [group.broadcast([flat], from_rank(0))]
                sent = flat.numel() * flat.element_size()
            else:
                payload = flat if delta is None else delta[1]
                works[name] = [group.broadcast([header], from_rank(0)), group.broadcast([payload], from_rank(0))]
                sent = header.numel() * 8 + payload.numel() * payload.element_size()
            self.egress[name] = self.egress.get(name, 0) + sent
        for name, group_works in works.items():
            for work in group_works:
                if not self._wait(offer, name, f"bucket {index + 1}/{len(offer.buckets)}", work):
                    break

    def _wait(self, offer: Offer, name: str, what: str, work) -> bool:
        try:
            work.wait()
            return True
        except RuntimeError as err:
            log.warning(
                f"collective weights v{offer.version}: {what} to group {name} failed on the trainer side "
                f"({first_line(err)}); that replica is left out until it joins again"
            )
            self.groups.pop(name, None)
            return False
