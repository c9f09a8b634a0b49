"""A worker's side of the collective weights (primerl.transport.collective): the replica groups it joins, the buckets
it receives, and with `weights.delta` the version it proved last, which the next one may be rebuilt from
(primerl.transport.delta).

A delta is taken only against a base whose fingerprint is the offer's: the group's first worker announces its own
before the first bucket, and the trainer sends deltas only if it matches. Another worker of the same replica whose
base differs (it failed the load before, alone) receives the deltas it cannot use and fails its load with one line;
the base is spent by every load and set again only by a proven one (`settle`), so a failed or torn load leaves none
and the next version arrives whole.
"""

import uuid
from collections.abc import Iterator

import torch
import torch.distributed as dist

from primerl.transport.collective import TransferError, _first_line, _from, _hex, join_group
from primerl.transport.delta import WHOLE, Base, decode, delta_bytes
from primerl.transport.fingerprint import FINGERPRINT_BYTES
from primerl.transport.offer import Offer


class WeightReceiver:
    """A worker's groups, by the sender they belong to (a restarted trainer's offers need new ones), and its base."""

    def __init__(self) -> None:
        self.nonce = uuid.uuid4().hex[:12]
        self.joins = 0  # counts the groups this worker lost: the next group it joins has a fresh name
        self.groups: dict[tuple[str, str], dist.ProcessGroup] = {}
        self.stores: dict[str, dist.Store] = {}
        self.base: Base | None = None  # the version this worker proved last, with weights.delta
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
        trainer sends them)."""
        group = self._group(offer, name, rank, world)
        base, self.base = self.base, None  # spent by this load, whatever its end
        self._received = Base("", offer.buckets, []) if offer.delta else None
        takes_delta = bool(offer.base) and self._announce(offer, group, name, rank, base, device) == offer.base
        usable = base if base is not None and base.fingerprint == offer.base and base.serves(offer.buckets) else None
        if takes_delta and usable is None:  # received all the same, so the trainer and the other workers go on
            for index in range(len(offer.buckets)):
                self._bucket(offer, group, name, index, device, takes_delta, None)
            raise TransferError(
                f"collective weights v{offer.version}: group {name} took a delta against {offer.base}, which this "
                "worker does not hold (its last load failed); the next version comes whole"
            )
        for index, bucket in enumerate(offer.buckets):
            flat = self._bucket(offer, group, name, index, device, takes_delta, usable)
            if self._received is not None:
                self._received.buckets.append(flat.cpu())
            offset = 0
            for spec in bucket:
                yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
                offset += spec.numel

    def _announce(self, offer: Offer, group, name: str, rank: int, base: Base | None, device) -> str:
        """The fingerprint of the base the group's first worker holds, as it announces it to all."""
        mine = base.fingerprint if base is not None and base.serves(offer.buckets) else ""
        held = bytes.fromhex(mine) if rank == 1 and mine else bytes(FINGERPRINT_BYTES)
        announced = torch.tensor(list(held), dtype=torch.uint8, device=device)
        self._wait(offer, group, name, "the base announcement", announced, root=1)
        return _hex(announced)

    def _bucket(self, offer: Offer, group, name: str, index: int, device, takes_delta: bool, base: Base | None):
        """Bucket `index`, flat; None when it came as a delta this worker cannot rebuild (no usable base)."""
        specs = offer.buckets[index]
        dtype, numel = getattr(torch, specs[0].dtype), sum(spec.numel for spec in specs)
        what = f"bucket {index + 1}/{len(offer.buckets)}"
        changed = WHOLE
        if takes_delta:
            header = torch.empty(1, dtype=torch.int64, device=device)
            self._wait(offer, group, name, what, header)
            changed = int(header.item())
        if changed == WHOLE:
            flat = torch.empty(numel, dtype=dtype, device=device)
            self._wait(offer, group, name, what, flat)
            return flat
        element_size = torch.empty((), dtype=dtype).element_size()
        payload = torch.empty(delta_bytes(numel, element_size, changed), dtype=torch.uint8, device=device)
        self._wait(offer, group, name, what, payload)
        if base is None:
            return None
        try:
            return decode(base.buckets[index], changed, payload)
        except ValueError as err:
            raise TransferError(f"collective weights v{offer.version}: {what} of group {name}: {err}") from err

    def _wait(self, offer: Offer, group, name: str, what: str, tensor: torch.Tensor, root: int = 0) -> None:
        try:
            group.broadcast([tensor], _from(root)).wait()
        except RuntimeError as err:
            del self.groups[(offer.sender, name)]
            self.joins += 1
            raise TransferError(
                f"collective weights v{offer.version}: {what} did not arrive on the worker side of group {name} "
                f"within {2 * offer.timeout_s:g}s (2 x weights.timeout_s): {_first_line(err)}"
            ) from err

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
