"""A worker's side of the collective weights (primerl.transport.collective): the replica groups it joins, the buckets
it receives, and with `weights.delta` the version it proved last, which the next one may be rebuilt from
(primerl.transport.delta).

A delta is taken only against a base whose fingerprint is the offer's: the group's first worker announces its own
before the first bucket, and the trainer sends deltas only if it matches. Another worker of the same replica whose
base differs (it failed the load before, alone) receives the deltas it cannot use and fails its load with one line;
the base is spent by every load and set again only by a proven one (`settle`), so a failed or torn load leaves none
and the next version arrives whole.
"""

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from primerl.transport.delta import WHOLE, Base, decode, delta_bytes
from primerl.transport.fingerprint import FINGERPRINT_BYTES
from primerl.transport.groups import TransferError, as_hex, first_line, from_rank, join_group, least
from primerl.transport.offer import Offer
from primerl.transport.relay import Link, plan_tensor, read_plan, relay_group

log = logging.getLogger(__name__)


class WeightReceiver:
    """A worker's groups, by the sender they belong to (a restarted trainer's offers need new ones), and its base."""

    def __init__(self) -> None:
        self.nonce = uuid.uuid4().hex[:12]
        self.joins = 0  # counts the groups this worker lost: the next group it joins has a fresh name
        self.groups: dict[tuple[str, str], dist.ProcessGroup] = {}
        self.stores: dict[str, dist.Store] = {}
        self.base: Base | None = None  # the version this worker proved last, with weights.delta
        # with weights.relay: the relay groups of the chains now, by the sender whose store they formed in and name
        self.relays: dict[tuple[str, str], dist.ProcessGroup] = {}
        self._received: Base | None = None  # the load in progress, until `settle`

    @property
    def identity(self) -> str:
        return f"{self.nonce}.{self.joins}"

    def settle(self, proven: str | None) -> None:
        """After a load: what it received becomes the base when the load was proven to serve `proven`."""
        received, self._received, self.base = self._received, None, None
        if proven and received is not None and received.serves(received.plan):
            self.base = Base(proven, received.plan, received.buckets)

    def tensors(
        self, offer: Offer, name: str, rank: int, world: int, device: torch.device
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The offer's tensors, received bucket by bucket as the caller iterates (rebuilt from deltas where the
        trainer sends them; from the replica before this one, and passed on, with relay)."""
        group = self._group(offer, name, rank, world)
        base, self.base = self.base, None  # spent by this load, whatever its end
        self._received = Base("", offer.buckets, []) if offer.delta else None
        takes_delta = bool(offer.base) and self._announce(offer, group, name, rank, base, device) == offer.base
        usable = base if base is not None and base.fingerprint == offer.base and base.serves(offer.buckets) else None
        link = self._link(offer, group, name, device) if offer.relay else None
        source, sink = (group, None) if link is None else self._relays(offer, group, name, rank, world, link)
        total, have = len(offer.buckets), 0
        while have < total and source is not None:
            pieces = self._pieces(offer, source, name, have, device, takes_delta, relayed=source is not group)
            if pieces is None:  # the relay before this replica is gone: the trainer sends the rest
                break
            sink = self._forward(offer, sink, pieces)
            yield from self._unpacked(offer, name, have, pieces, usable)
            have += 1
        if link is not None:
            missing = torch.tensor([have], dtype=torch.int64, device=device)
            self._wait(offer, name, "the relay status", group.allreduce([missing], least()))
            for index in range(int(missing.item()), total):  # what a member of this replica lacks
                pieces = self._pieces(offer, group, name, index, device, takes_delta, relayed=False)
                if index >= have:
                    sink = self._forward(offer, sink, pieces)
                    yield from self._unpacked(offer, name, index, pieces, usable)
        if takes_delta and usable is None:
            raise TransferError(
                f"collective weights v{offer.version}: group {name} took a delta against {offer.base}, which this "
                "worker does not hold (its last load failed); the next version comes whole"
            )

    def _announce(self, offer: Offer, group, name: str, rank: int, base: Base | None, device) -> str:
        """The fingerprint of the base the group's first worker holds, as it announces it to all."""
        mine = base.fingerprint if base is not None and base.serves(offer.buckets) else ""
        held = bytes.fromhex(mine) if rank == 1 and mine else bytes(FINGERPRINT_BYTES)
        announced = torch.tensor(list(held), dtype=torch.uint8, device=device)
        self._wait(offer, name, "the base announcement", group.broadcast([announced], from_rank(1)))
        return as_hex(announced)

    def _link(self, offer: Offer, group, name: str, device) -> Link:
        plan = plan_tensor(None, device)
        self._wait(offer, name, "the relay plan", group.broadcast([plan], from_rank(0)))
        return read_plan(plan)

    def _relays(self, offer: Offer, group, name: str, rank: int, world: int, link: Link):
        """(where this worker receives from, where it sends on): its replica's group with the trainer or the relay
        group from the replica before it (None if that did not form); the relay group to the next replica, for the
        first worker (None: none, or it did not form)."""
        source_name = relay_group(link.source, name, link.epoch) if link.source else ""
        sink_name = relay_group(name, link.sink, link.epoch) if link.sink and rank == 1 else ""
        wanted = {(offer.sender, source_name), (offer.sender, sink_name)}
        self.relays = {key: relay for key, relay in self.relays.items() if key in wanted}
        source = self._relay(offer, source_name, rank, world) if source_name else group
        return source, self._relay(offer, sink_name, 0, link.sink_world) if sink_name else None

    def _relay(self, offer: Offer, name: str, rank: int, world: int) -> dist.ProcessGroup | None:
        """Relay group `name`, joined unless this worker holds it already; None when it did not form (logged)."""
        key = (offer.sender, name)
        if key in self.relays:
            return self.relays[key]
        # half the limit: a replica whose relay stalls must give its status before the trainer stops waiting for it
        try:
            self.relays[key] = join_group(
                self.stores[offer.store], name, rank, world, offer.backend, offer.timeout_s / 2, offer.host
            )
            return self.relays[key]
        except RuntimeError as err:
            log.warning("primerl: v%d: relay group %s did not form: %s", offer.version, name, first_line(err))
            return None

    def _pieces(self, offer: Offer, group, name: str, index: int, device, takes_delta: bool, relayed: bool):
        """Bucket `index` as it travels: [header, delta or whole] to a delta taker, [whole] otherwise. From a relay
        group, None when it broke (logged)."""
        specs = offer.buckets[index]
        dtype, numel = getattr(torch, specs[0].dtype), sum(spec.numel for spec in specs)
        what = f"bucket {index + 1}/{len(offer.buckets)}"
        pieces = []
        if takes_delta:
            pieces.append(torch.empty(1, dtype=torch.int64, device=device))
            if not self._receive(offer, group, name, what, pieces[-1], relayed):
                return None
        changed = int(pieces[0].item()) if takes_delta else WHOLE
        if changed == WHOLE:
            pieces.append(torch.empty(numel, dtype=dtype, device=device))
        else:
            element_size = torch.empty((), dtype=dtype).element_size()
            pieces.append(torch.empty(delta_bytes(numel, element_size, changed), dtype=torch.uint8, device=device))
        return pieces if self._receive(offer, group, name, what, pieces[-1], relayed) else None

    def _receive(self, offer: Offer, group, name: str, what: str, tensor: torch.Tensor, relayed: bool) -> bool:
        if not relayed:
            self._wait(offer, name, what, group.broadcast([tensor], from_rank(0)))
            return True
        try:
            group.broadcast([tensor], from_rank(0)).wait()
            return True
        except RuntimeError as err:
            log.warning("primerl: v%d: %s from the relay before %s: %s", offer.version, what, name, first_line(err))
            self._drop(group)
            return False

    def _forward(self, offer: Offer, sink, pieces: list[torch.Tensor]):
        """Send a bucket's pieces on to the next replica; the relay group, or None once it broke (logged)."""
        if sink is None:
            return None
        try:
            for piece in pieces:
                sink.broadcast([piece], from_rank(0)).wait()
            return sink
        except RuntimeError as err:
            log.warning("primerl: v%d: the relay to the next replica broke: %s", offer.version, first_line(err))
            self._drop(sink)
            return None

    def _drop(self, broken: dist.ProcessGroup) -> None:
        self.relays = {key: relay for key, relay in self.relays.items() if relay is not broken}

    def _unpacked(self, offer: Offer, name: str, index: int, pieces: list[torch.Tensor], usable: Base | None):
        """Bucket `index`'s tensors, rebuilt from a delta on `usable`; none when this worker cannot rebuild it."""
        if len(pieces) == 1 or int(pieces[0].item()) == WHOLE:
            flat = pieces[-1]
        elif usable is None:
            return
        else:
            try:
                flat = decode(usable.buckets[index], int(pieces[0].item()), pieces[1])
            except ValueError as err:
                what = f"bucket {index + 1}/{len(offer.buckets)}"
                raise TransferError(f"collective weights v{offer.version}: {what} of group {name}: {err}") from err
        if self._received is not None:
            self._received.buckets.append(flat.cpu())
        offset = 0
        for spec in offer.buckets[index]:
            yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
            offset += spec.numel

    def _wait(self, offer: Offer, name: str, what: str, work) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            del self.groups[(offer.sender, name)]
            self.joins += 1
            raise TransferError(
                f"collective weights v{offer.version}: {what} did not arrive on the worker side of group {name} "
                f"within {2 * offer.timeout_s:g}s (2 x weights.timeout_s): {first_line(err)}"
            ) from err

    def _group(self, offer: Offer, name: str, rank: int, world: int) -> dist.ProcessGroup:
        key = (offer.sender, name)
        if key not in self.groups:
            self.groups = {k: g for k, g in self.groups.items() if k[0] == offer.sender}
            if not Path(offer.store).is_file():  # a sender's store lives as long as its trainer: this one is gone
                raise TransferError(
                    f"collective weights v{offer.version}: its sender is gone (no rendezvous file {offer.store}); "
                    "that version will never be sent"
                )
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
                    f"{offer.timeout_s:g}s (weights.timeout_s): {first_line(err)}"
                ) from err
        return self.groups[key]
