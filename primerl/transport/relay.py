"""Each byte leaves the trainer once (`weights.relay=true`, collective transport): the replicas pass each bucket on.

The replica groups of a version form chains, in name order: one of the groups that take deltas, one of the others
(primerl.transport.delta; without deltas, one chain). Trainer rank 0 sends each bucket into the first group of each
chain only; each replica's first worker, as it receives a bucket, sends it on into a relay group of its own (it as
rank 0, the next replica's workers after it). So the trainer's link carries each bucket once per chain, at most
twice, whatever the number of replicas; the price is a bucket's time per hop in latency.

A replica's own group with the trainer stays, and carries each version's plan (`Link`: where the replica receives
from, where it sends on) before the first bucket, and a status after the last: every member's first bucket missing
(an allreduce, MIN). A relay that dies or stalls costs only itself the version: the replica after it fails its relay
receive, says from which bucket it lacks the version, and the trainer sends it the rest from its copy of the version
(kept for the transfer), which it passes on as before, so the chain behind it goes on unaware. The trainer takes the
statuses in chain order, so a replica waiting on a repaired one is answered after it. A dead relay is seen at once
when its process dies (its sockets close); a relay on a node that went away is seen after `weights.timeout_s`, and
the replica behind it may then lose the version too (its status comes after the trainer's wait).

Relay groups last while their chain does: named by both replicas' groups and the chain's epoch (the version at which
the trainer last formed the chains: a change of members or a broken relay starts a new one), so a version whose
chains are those of the last one reuses its relay groups (an NCCL communicator costs far more to form than a bucket
to send), and a relay that broke is never joined again under its old name.
"""

import json
from dataclasses import asdict, dataclass

import torch

PLAN_BYTES = 512  # a plan is JSON of two group names ("r<i>-<12 hex>.<joins>") and a count, padded with zeros


@dataclass(frozen=True)
class Link:
    """One replica group's place in its chain: the group it receives from ("": the trainer, in its own group), the
    group it sends on to ("": none) and that group's size."""

    source: str = ""
    sink: str = ""
    sink_world: int = 0
    epoch: int = 0  # the version at which the trainer formed these chains


def chains(groups: list[str], takers: set[str]) -> list[list[str]]:
    """The chains of a version: the delta takers, then the others, each in name order (empty ones left out)."""
    ordered = sorted(groups)
    found = [[name for name in ordered if name in takers], [name for name in ordered if name not in takers]]
    return [chain for chain in found if chain]


def links(chained: list[list[str]], worlds: dict[str, int], epoch: int) -> dict[str, Link]:
    found = {}
    for chain in chained:
        for position, name in enumerate(chain):
            source = chain[position - 1] if position else ""
            sink = chain[position + 1] if position + 1 < len(chain) else ""
            found[name] = Link(source, sink, worlds[sink] if sink else 0, epoch)
    return found


def relay_group(source: str, sink: str, epoch: int) -> str:
    return f"{source}>{sink}.e{epoch}"


def plan_tensor(link: Link | None, device: torch.device) -> torch.Tensor:
    """`link` as the fixed-size tensor the trainer broadcasts (None: an empty one, as a receiver posts it)."""
    data = json.dumps(asdict(link)).encode() if link is not None else b""
    if len(data) > PLAN_BYTES:
        raise ValueError(f"a relay plan of {len(data)} bytes does not fit in {PLAN_BYTES}: {data[:80]!r}...")
    return torch.tensor(list(data.ljust(PLAN_BYTES, b"\0")), dtype=torch.uint8, device=device)


def read_plan(tensor: torch.Tensor) -> Link:
    return Link(**json.loads(bytes(tensor.cpu().tolist()).rstrip(b"\0")))
