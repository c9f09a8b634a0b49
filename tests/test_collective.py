"""Weights by process group (primerl.transport.collective) and their fingerprint: buckets, a send to several replica
groups over real gloo on loopback, a stalled transfer that fails in one line, and the trainer's side under torchrun
(FSDP2 on 2 ranks, and a MoE under expert parallel) sending exactly the tensors it writes as files."""

import itertools
import json
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from primerl.config.model import TinyArchConfig
from primerl.model.tiny import build_tiny_model
from primerl.transport.collective import WeightSender
from primerl.transport.fingerprint import fingerprint_of
from primerl.transport.groups import TransferError
from primerl.transport.offer import Offer, TensorSpec, plan_buckets, spec_of
from primerl.transport.receiver import WeightReceiver
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import RECEIVERS_FILE, answer_offer, read_json_file
from tests.conftest import run_module

TENSORS = {
    "a": torch.randn(100, 7).bfloat16(),
    "b": torch.randn(3).bfloat16(),
    "c": torch.randn(5000).float(),
    "d": torch.randn(10).float(),
}


def _listening_sockets() -> set[str]:
    """The inodes of this process's listening TCP sockets."""
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:
                listening.add(fields[9])
    return listening


def test_the_rendezvous_is_a_file_in_the_runs_private_weights_directory_and_workers_join_no_other(tmp_path):
    """No port to join: the sender listens on nothing (a TCPStore let any local user list the groups, join one as
    rank 0 before the trainer and fill its memory); its store is a file in a 0700 directory below the run's weights,
    and a worker refuses an offer whose store is anywhere else."""
    from primerl.transport.run_dir import weights_root
    from primerl.transport.weights import rendezvous_dir, store_refusal

    before = _listening_sockets()
    sender = WeightSender("127.0.0.1", rendezvous_dir(tmp_path), "gloo", timeout_s=3)
    assert _listening_sockets() == before
    offer = sender.offer(1, plan_buckets([spec_of(name, tensor) for name, tensor in TENSORS.items()], 4096))
    store = rendezvous_dir(tmp_path) / f"{sender.id}.store"
    assert offer.store == str(store) and store.exists() and (store.parent.stat().st_mode & 0o777) == 0o700
    assert store_refusal(offer.store, weights_root(tmp_path)) is None
    for elsewhere in ("/tmp/x.store", str(weights_root(tmp_path) / ".." / "x.store")):
        assert "is not inside the run's weights directory" in store_refusal(elsewhere, weights_root(tmp_path))


def test_buckets_hold_one_dtype_and_at_most_their_bound_and_a_larger_tensor_goes_alone():
    specs = [spec_of(name, tensor) for name, tensor in TENSORS.items()]
    buckets = plan_buckets(specs, 4096)
    assert [[spec.name for spec in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]
    assert sum(spec.nbytes for spec in buckets[0]) == 1406 and buckets[1][0].nbytes == 20000 > 4096
    assert plan_buckets([TensorSpec("x", "float32", (4,))] * 3, 32) == [[TensorSpec("x", "float32", (4,))] * 2] * 1 + [
        [TensorSpec("x", "float32", (4,))]
    ]


def test_the_fingerprint_follows_every_tensor_not_their_order():
    same = fingerprint_of(dict(reversed(list(TENSORS.items()))))
    assert fingerprint_of(TENSORS) == same
    for name in TENSORS:
        changed = {**TENSORS, name: TENSORS[name].clone()}
        changed[name].view(-1)[0] += 1  # the first element: in every sample
        assert fingerprint_of(changed) != same, name
    big = torch.randn(1024, 1024)
    for changed in (1, 1024 * 1024 - 4096):  # one element; all but a strided sample's 4096 (caught by sampling none)
        moved = big.clone().view(-1)
        keep = torch.arange(0, moved.numel(), moved.numel() // 4096)[: moved.numel() - changed]
        mask = torch.ones(moved.numel(), dtype=torch.bool)
        mask[keep] = False
        moved[mask.nonzero()[:changed, 0]] += 1e-3
        assert fingerprint_of({"w": big}) != fingerprint_of({"w": moved.view(1024, 1024)}), changed
    assert fingerprint_of({"w": big}) != fingerprint_of({"w2": big})  # the name counts


def test_the_first_answer_to_an_offer_stands(tmp_path):
    """The orchestrator's answer and the trainer's withdrawal (no groups) race: whichever is in place first is the
    answer both act on; an answer to another offer id is none."""
    assert answer_offer(tmp_path, "offer-1", {}) == {}  # the trainer withdrew it
    assert answer_offer(tmp_path, "offer-1", {"r0-a.0": 2}) == {}  # a late answer does not replace it
    again = tmp_path / "again"
    again.mkdir()
    assert answer_offer(again, "offer-2", {"r0-a.0": 2}) == {"r0-a.0": 2}
    assert answer_offer(again, "offer-2", {}) == {"r0-a.0": 2}  # a late withdrawal neither
    assert read_json_file(again / RECEIVERS_FILE) == {"offer": "offer-2", "groups": {"r0-a.0": 2}}
    assert answer_offer(again, "offer-3", {}) == {}  # the standing answer is another offer's
    assert sorted(path.name for path in again.iterdir()) == [RECEIVERS_FILE]  # no temporaries left


def _send(sender: WeightSender, offer: Offer, groups: dict[str, int], buckets_sent: int | None = None) -> None:
    """The trainer's side: TENSORS, whole, or cut short after `buckets_sent` buckets (then the sender says so)."""
    if buckets_sent is None:
        assert sender.transfer(offer, groups, iter(TENSORS.items())) == fingerprint_of(TENSORS)
        return
    cut = itertools.islice(TENSORS.items(), sum(len(bucket) for bucket in offer.buckets[:buckets_sent]))
    with pytest.raises(RuntimeError, match=f"v{offer.version}: the trainer had nothing more where its offer announced"):
        sender.transfer(offer, groups, cut)


def _receive(receiver: WeightReceiver, offer: Offer, group: str, out: dict) -> None:
    try:
        out[group] = {
            name: tensor.clone() for name, tensor in receiver.tensors(offer, group, 1, 2, torch.device("cpu"))
        }
    except TransferError as err:
        out[group] = err


def test_a_version_sent_to_two_replica_groups_arrives_whole_and_a_group_that_never_joins_is_left_out(caplog, tmp_path):
    buckets = plan_buckets([spec_of(name, tensor) for name, tensor in TENSORS.items()], 4096)
    sender = WeightSender("127.0.0.1", tmp_path, "gloo", timeout_s=3)
    offer = Offer.from_json(json.loads(json.dumps(sender.offer(3, buckets).to_json())))  # as read from its file
    receivers, out = [WeightReceiver(), WeightReceiver()], {}
    groups = {f"r{i}-{receiver.identity}": 2 for i, receiver in enumerate(receivers)}
    threads = [
        threading.Thread(target=_receive, args=(receiver, offer, name, out))
        for receiver, name in zip(receivers, groups, strict=True)
    ]
    for thread in threads:
        thread.start()
    _send(sender, offer, {**groups, "r2-never.0": 2})  # replica 2 was named but never joins
    for thread in threads:
        thread.join()
    for name in groups:
        assert fingerprint_of(out[name]) == fingerprint_of(TENSORS) and out[name].keys() == TENSORS.keys()
    assert set(sender.groups) == set(groups)
    assert "group r2-never.0 did not form on the trainer side within 3s (weights.timeout_s)" in caplog.text

    # the next version reuses the groups: no new join
    offer = Offer.from_json(sender.offer(4, buckets).to_json())
    threads = [
        threading.Thread(target=_receive, args=(receiver, offer, name, out))
        for receiver, name in zip(receivers, groups, strict=True)
    ]
    for thread in threads:
        thread.start()
    _send(sender, offer, groups)
    for thread in threads:
        thread.join()
    assert all(fingerprint_of(out[name]) == fingerprint_of(TENSORS) for name in groups)


def test_a_transfer_that_stalls_fails_on_the_worker_side_in_one_line_naming_the_bucket_and_the_group(tmp_path):
    buckets = plan_buckets([spec_of(name, tensor) for name, tensor in TENSORS.items()], 4096)
    sender = WeightSender("127.0.0.1", tmp_path, "gloo", timeout_s=2)
    offer = Offer.from_json(sender.offer(5, buckets).to_json())
    receiver, out = WeightReceiver(), {}
    name = f"r0-{receiver.identity}"
    thread = threading.Thread(target=_receive, args=(receiver, offer, name, out))
    thread.start()
    _send(sender, offer, {name: 2}, buckets_sent=1)  # the trainer sends bucket 1 of 3, then nothing
    thread.join(timeout=60)
    error = out[name]
    assert isinstance(error, TransferError) and "\n" not in str(error)
    expected = f"v5: bucket 2/3 did not arrive on the worker side of group {name} within 4s (2 x weights.timeout_s)"
    assert expected in str(error)
    assert receiver.identity != name.removeprefix("r0-")  # its next group gets a fresh name
    assert not receiver.groups


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense-fsdp2", "moe-ep2"])
def test_the_trainer_sends_on_two_ranks_bucket_by_bucket_exactly_what_it_writes_as_files(cache_dir, tmp_path, moe):
    arch = TinyArchConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64) if moe else TinyArchConfig()
    base = build_tiny_model(str(cache_dir), arch, init_seed=0)
    result = run_module("tests.workers.collective_publish", str(base), str(tmp_path), "2" if moe else "1", torchrun=2)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "publish-2.json").read_text())
    received = load_file(tmp_path / "received-2.safetensors")
    written = load_file(weights_path(tmp_path / "run", 1) / "model.safetensors")
    assert received.keys() == written.keys() and all(torch.equal(received[k], written[k]) for k in written)
    assert all(v.dtype == torch.bfloat16 for v in received.values())  # the served dtype, from fp32 masters
    assert "lm_head.weight" not in received  # tied: vLLM ties it again
    if moe:  # the per-expert layout vLLM's loader reads
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in received
    assert record["sent_fingerprint"] == record["file_fingerprint"] == record["published_fingerprint"]
    assert len(record["bucket_bytes"]) > 1 and max(record["bucket_bytes"]) <= 1 << 20  # bounded by weights.bucket_mb


@pytest.mark.parametrize("by_numpy", [True, False], ids=["numpy-as-on-cpu", "torch-as-on-gpu"])
def test_a_delta_rebuilds_every_bit_and_is_not_sent_where_it_would_not_be_smaller(by_numpy):
    from primerl.transport.delta import decode, encode, pack_bits, unpack_bits

    mask = torch.rand(1001) < 0.3  # the packing a GPU runs, as numpy's on CPU
    assert torch.equal(pack_bits(mask), torch.from_numpy(np.packbits(mask.numpy(), bitorder="little")))
    assert torch.equal(unpack_bits(pack_bits(mask), 1001), mask) and pack_bits(mask).numel() == 126
    base = torch.randn(1001).bfloat16()
    base[:3] = torch.tensor([0.0, float("nan"), 1.0])
    new = base.clone()
    new[500:600] += 1
    new[0] = -0.0  # equal as values, not as bits
    new[1] = torch.tensor(-1, dtype=torch.int16).view(torch.bfloat16)  # another NaN
    differ = int((new.view(torch.int16) != base.view(torch.int16)).sum())
    changed, payload = encode(new, base, by_numpy)
    assert changed == differ > 100 and payload.numel() == 126 + 2 * differ  # the mask, then the values
    assert torch.equal(payload, encode(new, base, not by_numpy)[1])  # the same bytes either way
    assert torch.equal(decode(base, changed, payload, by_numpy).view(torch.int16), new.view(torch.int16))
    with pytest.raises(ValueError, match=f"mask marks {differ} values where its header says {differ - 1}"):
        decode(base, differ - 1, payload[:-2], by_numpy)
    assert encode(base + 1, base, by_numpy) is None  # every value changed: the bucket goes whole
    unchanged = decode(base, 0, encode(base, base, by_numpy)[1], by_numpy)
    assert encode(base, base, by_numpy)[0] == 0 and unchanged.view(torch.int16).equal(base.view(torch.int16))
    wide = torch.randn(77)
    moved = wide.where(torch.arange(77) % 7 != 0, 0.0)
    changed, payload = encode(moved, wide, by_numpy)
    assert changed == 11 and torch.equal(decode(wide, changed, payload, by_numpy), moved)


def _moved(tensors: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """`tensors` with about `share` of each one's values changed."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor.where(torch.rand(tensor.shape, generator=generator) > share, tensor + 1)
        for name, tensor in tensors.items()
    }


def _version(sender, offer, tensors, groups: dict[str, int], workers: dict[str, list]) -> dict:
    """One version sent to `groups`, each worker in its own thread: {(group, rank): tensors or TransferError}."""
    out = {}

    def receive(receiver, group, rank):
        try:
            got = {n: t.clone() for n, t in receiver.tensors(offer, group, rank, groups[group], torch.device("cpu"))}
            out[group, rank] = got
        except TransferError as err:
            out[group, rank] = err

    threads = [
        threading.Thread(target=receive, args=(receiver, group, rank))
        for group, members in workers.items()
        for rank, receiver in enumerate(members, start=1)
    ]
    for thread in threads:
        thread.start()
    assert sender.transfer(offer, groups, iter(tensors.items())) == fingerprint_of(tensors)
    for thread in threads:
        thread.join(timeout=60)
    return out


def test_deltas_go_only_to_replicas_that_proved_the_base_and_rebuild_the_version_bit_for_bit(tmp_path):
    """Three replicas (one of two workers). v1 goes whole (no base yet); r0 and r1 prove it, r2 does not; v2 goes as a
    delta to r0 and r1 (fewer bytes), whole to r2. For v3 all three take a delta; the second worker of r1, which lost
    its base (its load failed alone), receives it all the same and fails in one line, holding up nobody."""
    buckets = plan_buckets([spec_of(name, tensor) for name, tensor in TENSORS.items()], 4096)
    sender = WeightSender("127.0.0.1", tmp_path, "gloo", timeout_s=20, delta=True)
    workers = {f"r0-{i}": [WeightReceiver()] for i in range(3)}
    workers["r1-x"] = workers.pop("r0-1") + [WeightReceiver()]
    groups = {name: 1 + len(members) for name, members in workers.items()}
    versions = [TENSORS, _moved(TENSORS, 0.1, 1), _moved(TENSORS, 0.1, 2)]

    offer = sender.offer(1, buckets)
    assert offer.delta and offer.base == ""  # nothing sent yet: nothing to build a delta on
    out = _version(sender, offer, versions[0], groups, workers)
    assert all(fingerprint_of(got) == fingerprint_of(versions[0]) for got in out.values())
    whole = sender.egress["r0-0"]
    for name, members in workers.items():
        for receiver in members:
            receiver.settle(fingerprint_of(versions[0]) if name != "r0-2" else None)  # r2's load was not proven

    offer = Offer.from_json(json.loads(json.dumps(sender.offer(2, buckets).to_json())))
    assert offer.base == fingerprint_of(versions[0])
    out = _version(sender, offer, versions[1], groups, workers)
    assert all(fingerprint_of(got) == fingerprint_of(versions[1]) for got in out.values())
    assert all(
        torch.equal(got[n].view(torch.uint8), versions[1][n].view(torch.uint8)) for got in out.values() for n in got
    )
    assert sender.delta_takers == {"r0-0", "r1-x"}
    assert sender.egress["r0-2"] == whole and sender.egress["r0-0"] < whole / 2, sender.egress
    for name, members in workers.items():
        for rank, receiver in enumerate(members, start=1):
            receiver.settle(fingerprint_of(versions[1]) if (name, rank) != ("r1-x", 2) else None)

    started = time.monotonic()
    out = _version(sender, sender.offer(3, buckets), versions[2], groups, workers)
    assert time.monotonic() - started < 10  # nobody waited out the 20 s limit
    assert sender.delta_takers == set(groups) == set(sender.groups)  # r2 proved v2: it takes deltas now
    error = out["r1-x", 2]
    assert isinstance(error, TransferError) and "\n" not in str(error)
    assert f"group r1-x took a delta against {fingerprint_of(versions[1])}, which this worker does not hold" in str(
        error
    )
    assert fingerprint_of(out["r0-0", 1]) == fingerprint_of(out["r1-x", 1]) == fingerprint_of(versions[2])
    assert fingerprint_of(out["r0-2", 1]) == fingerprint_of(versions[2])


def _replica_process(conn) -> None:
    """A replica of one worker in its own process: it receives the offers it is sent, and with `die` set kills itself
    -9 once it passed its first bucket on."""
    import os
    import signal

    receiver = WeightReceiver()
    conn.send(receiver.identity)
    while (message := conn.recv()) is not None:
        offer, group, die = Offer.from_json(message[0]), message[1], message[2]
        got = {}
        for name, tensor in receiver.tensors(offer, group, 1, 2, torch.device("cpu")):
            got[name] = tensor.clone()
            if die and len(got) == len(offer.buckets[0]):
                os.kill(os.getpid(), signal.SIGKILL)
        conn.send(fingerprint_of(got))
        receiver.settle(conn.recv())


def test_with_relay_each_bucket_leaves_the_trainer_once_and_a_relay_that_dies_costs_only_itself(caplog, tmp_path):
    """Three replicas in a chain (r0 -> r1 -> r2; r1 a process of its own, r2 of two workers). v1 goes whole: the
    trainer's egress is the version's bytes once, not three times. v2 goes as deltas down the same chain, and r1 is
    killed -9 once it passed its first bucket on: r2 says it lacks the rest, the trainer sends it from its copy, and
    r0 and r2 serve v2 bit for bit, within seconds (weights.timeout_s is 20). The chain without r1 forms a new relay
    group once and keeps it."""
    import multiprocessing as mp

    buckets = plan_buckets([spec_of(name, tensor) for name, tensor in TENSORS.items()], 4096)
    sender = WeightSender("127.0.0.1", tmp_path, "gloo", timeout_s=20, delta=True, relay=True)
    parent, child = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(target=_replica_process, args=(child,), daemon=True)
    process.start()
    local = {"r0": [WeightReceiver()], "r2": [WeightReceiver(), WeightReceiver()]}
    workers = {f"{replica}-{members[0].identity}": members for replica, members in local.items()}
    first, last = sorted(workers)
    remote = f"r1-{parent.recv()}"
    groups = {name: 1 + len(members) for name, members in workers.items()} | {remote: 2}
    versions = [TENSORS, _moved(TENSORS, 0.1, 1)]
    whole = sum(tensor.numel() * tensor.element_size() for tensor in TENSORS.values())

    try:
        for version, tensors in enumerate(versions, start=1):
            offer = sender.offer(version, buckets)
            assert offer.relay and bool(offer.base) == (version == 2)
            parent.send((offer.to_json(), remote, version == 2))
            started = time.monotonic()
            out = _version(sender, offer, tensors, groups, workers)
            assert time.monotonic() - started < 10
            assert all(fingerprint_of(got) == fingerprint_of(tensors) for got in out.values()), out
            if version == 1:
                assert parent.recv() == fingerprint_of(tensors)
                parent.send(fingerprint_of(tensors))
                assert sum(sender.egress.values()) == whole and sender.egress[first] == whole  # once, to r0
                for members in workers.values():
                    for receiver in members:
                        receiver.settle(fingerprint_of(tensors))
        process.join(timeout=10)
        assert process.exitcode == -9
        assert sender.delta_takers == set(groups) and remote not in sender.groups
        assert 0 < sender.egress[first] < whole / 2 and sender.egress[remote] == 0  # r1 got v2 from r0 only
        assert 0 < sender.egress[last] < sender.egress[first]  # the rest of v2, for r2
        assert "lost its relay at bucket 2/3; the trainer sends it the rest" in caplog.text

        # the chain without r1 forms a new relay group at v3, and v4 (same chain) reuses it
        del groups[remote]
        held = {}
        for version in (3, 4):
            out = _version(sender, sender.offer(version, buckets), TENSORS, groups, workers)
            assert all(fingerprint_of(got) == fingerprint_of(TENSORS) for got in out.values())
            assert sender.egress == {first: whole, last: 0}
            held[version] = dict(workers[last][0].relays)
        assert held[3] == held[4] and [name for _, name in held[3]] == [f"{first}>{last}.e3"]
    finally:
        process.kill()
