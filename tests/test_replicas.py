"""Inference replicas, orchestrator side: rollouts spread by least outstanding, a dead replica's rollouts run again on
another, weights loaded into every replica, and a replica taken back with the current policy. Fake servers (the
real vLLM path is in tests/test_faults.py)."""

import asyncio
import contextlib
import dataclasses
import os
import shutil
import socket
import time

import pytest

from primerl.envs.types import Rollout, RolloutFailure, ScoredBranch
from primerl.orchestrator import fanout
from primerl.orchestrator.health import Health
from primerl.orchestrator.inference_client import InferenceClient, Loaded, NotProven
from primerl.orchestrator.orchestrator import served_policy
from primerl.orchestrator.replicas import ReplicaRunner, Replicas
from primerl.orchestrator.types import Policy
from primerl.orchestrator.watcher import Watcher
from primerl.transport.atomic import STABLE_MARKER, write_json
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import (
    OFFER_FILE,
    RECEIVERS_FILE,
    UNPROVEN,
    is_offer,
    read_json_file,
    rendezvous_dir,
    write_fingerprint,
)
from primerl.utils.errors import RunError
from primerl.utils.liveness import Liveness
from tests.loopback import loopback_server


class FakeServer:
    """What the orchestrator sees of one vLLM replica: health, the version it serves, weight loads."""

    def __init__(self, name: str):
        self.base_url = f"http://{name}"  # where the orchestrator sends
        self.address = self.base_url  # where the server is (another place after a requeue)
        self.up = True
        self.hung = False  # /health gives no answer in time (a loaded or a hung server)
        self.served = 0
        self.loads: list[int] = []
        self.keeps_old_weights = False
        self.load_s = 0.01
        self.process = 0  # its workers' process: a restart gives its collective group a new name
        self.groups: list[str] = []  # the groups its collective loads were received in
        self.metrics_reads = 0
        self.probes = 0  # /health requests (the watcher's health round; not `healthy()`, which tests call too)
        self.paused = False  # a load that was not proven leaves the server paused until one is
        self.loading: asyncio.Future | None = None  # the load its workers are running

    async def health(self) -> bool | None:
        self.probes += 1
        return None if self.hung else await self.healthy()

    async def healthy(self) -> bool:
        return self.up and not self.hung and self.address == self.base_url

    def move_to(self, base_url: str) -> None:
        self.base_url = base_url

    async def wait_healthy(self, timeout_s: float, before_probe=lambda: None) -> None:
        for _ in range(int(timeout_s / 0.01)):
            before_probe()
            if await self.healthy():
                return
            await asyncio.sleep(0.01)
        raise RunError(f"{self.base_url} not healthy after {timeout_s}s")

    async def policy_version(self) -> int:
        if self.loading is not None:  # the workers answer calls in turn: after the load in progress
            await asyncio.wait([self.loading])
        return self.served

    async def load_weights(self, path, version: int, group: str = "") -> Loaded:
        if not await self.healthy():
            raise RuntimeError("connection refused")
        self.paused = True
        # the server's own work goes on when the caller gives up on it (vLLM does not cancel a dropped request)
        self.loading = asyncio.ensure_future(self._load(path, version, group))
        await asyncio.shield(self.loading)
        self.paused = False  # resumed: the load was proven
        return Loaded(0.01, fingerprint_of_version(version))

    async def _load(self, path, version: int, group: str) -> None:
        await asyncio.sleep(self.load_s)
        self.loads.append(version)
        if is_offer(path):
            assert group, "an offer is received in a group"
            self.groups.append(group)
        if self.keeps_old_weights:  # its workers find another fingerprint than the trainer's: paused, unproven
            self.served = UNPROVEN
            raise NotProven(f"{self.base_url} serves fingerprint {fingerprint_of_version(0)} after loading v{version}")
        self.served = version

    async def resume(self) -> None:
        self.paused = False

    async def running_requests(self) -> float | None:
        self.metrics_reads += 1
        return 0.0 if self.up else None

    async def collective_group(self, replica: int) -> tuple[str, int]:
        if not await self.healthy():
            raise RuntimeError("connection refused")
        return f"r{replica}-p{self.process}", 2


class ServerRunner:
    """Runs a rollout against one fake server: it takes `seconds`, and fails while the server is down."""

    def __init__(self, server: FakeServer, seconds: float = 0.05):
        self.server, self.seconds = server, seconds
        self.tasks: list = []
        self.cancelled: list = []

    async def run(self, task, seed=None):
        self.tasks.append(task)
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled.append(task)
            raise
        if not self.server.up:
            return [RolloutFailure("Connection error")]
        return [Rollout(1.0, {}, [ScoredBranch([1, 2], [False, True], [0.0, -0.1])], "ok")]


def replica_set(n: int, seconds: float = 0.05):
    servers = [FakeServer(f"replica{i}") for i in range(n)]
    replicas = Replicas(servers)
    runners = [ServerRunner(s, seconds) for s in servers]
    return servers, replicas, runners, ReplicaRunner(runners, replicas)


async def until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_rollouts_go_to_the_least_loaded_up_replica_and_a_dead_ones_run_again_elsewhere():
    servers, replicas, runners, runner = replica_set(3)

    async def main():
        # 9 at once: 3 each (least outstanding, ties to the lowest index)
        await asyncio.gather(*(runner.run(i) for i in range(9)))
        assert [len(r.tasks) for r in runners] == [3, 3, 3]
        assert replicas.outstanding == [0, 0, 0]
        # replica 1 dies: its next rollout fails, /health confirms, the rollout runs again on another replica
        servers[1].up = False
        results = await asyncio.gather(*(runner.run(100 + i) for i in range(6)))
        assert all(isinstance(e, Rollout) for entries in results for e in entries)  # none lost
        assert replicas.up == [True, False, True] and replicas.rerouted == 2
        assert sorted(t for t in runners[1].tasks if t >= 100) == [101, 104]  # tried there first, then moved
        assert sorted(t for r in (runners[0], runners[2]) for t in r.tasks if t >= 100) == [
            100,
            101,
            102,
            103,
            104,
            105,
        ]
        # nothing more goes to it while it is down
        await asyncio.gather(*(runner.run(200 + i) for i in range(4)))
        assert not [t for t in runners[1].tasks if t >= 200]
        # a failure on a replica that is up is the env's: counted as a failure, not rerouted
        runners[0].server, fake_down = FakeServer("broken-env"), runners[0].server
        runners[0].server.up = False  # the rollout fails, but replica 0 still answers /health
        assert isinstance((await runner.run(300))[0], RolloutFailure) and replicas.rerouted == 2
        assert replicas.up == [True, False, True]
        runners[0].server = fake_down
        # every replica down: the failure is returned, nothing hangs
        for server in servers:
            server.up = False
        entries = await runner.run(400)
        assert isinstance(entries[0], RolloutFailure) and not replicas.serving

    asyncio.run(main())


def test_the_heap_pick_is_the_linear_pick_under_any_sequence_of_changes():
    """`LeastLoaded` (the replicas' pick at scale) agrees with `least_outstanding` after every change: requests
    taken and finished, members down and up, with and without members excluded, across heap rebuilds."""
    import random

    from primerl.utils.pool import LeastLoaded, least_outstanding

    rng = random.Random(0)
    for members in (1, 3, 64):
        load, checked = LeastLoaded(members), 0
        for _ in range(5000):
            index, roll = rng.randrange(members), rng.random()
            if roll < 0.45:
                load.change(index, +1)
            elif roll < 0.85 and load.outstanding[index] > 0:
                load.change(index, -1)
            elif roll < 0.95:
                load.set_taking(index, not load.taking[index])
            exclude = set(rng.sample(range(members), rng.randrange(min(members, 3) + 1)))
            for excluded in (frozenset(), exclude):
                assert load.pick(excluded) == least_outstanding(load.outstanding, load.taking, excluded)
                checked += 1
            assert len(load._heap) <= 4 * members + 64 + 1
        assert checked == 10000


def test_free_ports_are_picked_below_the_kernels_ephemeral_range():
    """Ports the kernel hands to outgoing connections and port-0 binds (another process's, vLLM's internal sockets)
    are never picked for a server that binds later; each pick's consecutive ports are free."""
    from primerl.utils.process import EPHEMERAL_RANGE, _bindable, _unassigned_range, free_port

    low, high = _unassigned_range()
    if EPHEMERAL_RANGE.exists():
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
        assert (low, high) == ((10000, ephemeral_low - 1) if ephemeral_low > 10001 else (0, 0))
    for _ in range(20):
        first = free_port(count=4)
        assert all(_bindable("127.0.0.1", first + i) for i in range(4))
        if low:
            assert low <= first and first + 3 <= high


def test_the_idle_gauge_reads_one_up_replica_per_poll_in_turn():
    servers, replicas, _, _ = replica_set(3)
    replicas.mark_down(1, "test")

    async def main():
        return [await replicas.running_requests() for _ in range(5)]

    assert asyncio.run(main()) == [0.0] * 5
    assert [s.metrics_reads for s in servers] == [3, 0, 2]  # 0, 2, 0, 2, 0: one request a poll, none to the down one
    for index in (0, 2):
        replicas.mark_down(index, "test")
    assert asyncio.run(main()) == [None] * 5 and sum(s.metrics_reads for s in servers) == 5  # none up: nothing read


def test_a_rollout_on_a_replica_marked_down_runs_again_elsewhere_at_once():
    """The watcher's health check marks a replica down while a rollout is in flight there (its client would retry a
    dead server for longer than the rollout's timeout): the rollout is cancelled and runs on another replica now."""
    servers, replicas, runners, runner = replica_set(2, seconds=30)
    runners[1].seconds = 0.05

    async def main():
        first = asyncio.create_task(runner.run("a"))
        await until(lambda: replicas.outstanding == [1, 0])  # ties go to the lowest index
        started = time.monotonic()
        replicas.mark_down(0, "/health did not answer")
        entries = await asyncio.wait_for(first, 5)
        assert isinstance(entries[0], Rollout) and time.monotonic() - started < 1
        await until(lambda: runners[0].cancelled == ["a"])
        assert runners[1].tasks == ["a"] and replicas.rerouted == 1 and replicas.outstanding == [0, 0]
        # back up: rollouts go there again; one cancelled from outside (its timeout) leaves nothing running
        replicas.mark_up(0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(runner.run("b"), 0.2)
        await until(lambda: runners[0].cancelled == ["a", "b"])
        assert replicas.outstanding == [0, 0] and replicas.rerouted == 1

    asyncio.run(main())


def test_a_replica_slow_to_answer_health_stays_up_while_it_finishes_rollouts(tmp_path):
    """A loaded server answers /health late: it stays up while rollouts finish on it; one that also finishes nothing
    (hung) is marked down once the silence passes the limit. A refused /health is down at once."""
    servers, replicas, runners, runner = replica_set(2)
    replicas.liveness = Liveness("inference replicas", 0.3, 0.3, tick_s=0.1)
    watcher = Watcher(tmp_path, replicas, Policy(), 0.01, 5.0)

    async def probe_for(seconds: float, work: bool) -> None:
        for _ in range(int(seconds / 0.1)):
            if work:
                await asyncio.gather(*(runner.run(i) for i in range(2)))
            else:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)
            await watcher.probe()

    async def main():
        servers[0].hung = True
        await probe_for(1.0, work=True)  # ten times the limit: slow, but it keeps finishing rollouts
        assert replicas.up == [True, True] and len(runners[0].tasks) >= 5
        await probe_for(0.6, work=False)  # silent and idle: hung
        assert replicas.up == [False, True]
        servers[1].up = False  # refused: no waiting for a limit
        await watcher.probe()
        assert replicas.up == [False, False]

    asyncio.run(main())


@contextlib.asynccontextmanager
async def watching(watcher: Watcher):
    """`watcher` running for the block, cancelled and awaited after it."""
    task = asyncio.create_task(watcher.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def all_down(servers: list[FakeServer], watcher: Watcher) -> None:
    """Every replica dies; a health check takes them out and admission stops."""
    for server in servers:
        server.up = False
    watcher.check_health()
    await until(lambda: not watcher.serving)


def fingerprint_of_version(version: int) -> str:
    return f"fingerprint-of-v{version}"


def publish(run_dir, version: int) -> None:
    weights_path(run_dir, version).mkdir(parents=True)
    write_fingerprint(weights_path(run_dir, version), fingerprint_of_version(version))
    (weights_path(run_dir, version) / STABLE_MARKER).touch()


def test_weights_go_to_every_up_replica_and_a_returning_one_gets_the_current_policy(tmp_path):
    servers, replicas, runners, runner = replica_set(2)
    policy, changes = Policy(), []
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 0.5)
    watcher.on_change = lambda: changes.append(policy.version)  # set after building, as the orchestrator does

    async def main():
        task = asyncio.create_task(watcher.run())
        publish(tmp_path, 1)
        await until(lambda: policy.version == 1)
        assert [s.loads for s in servers] == [[1], [1]]  # both, in one update
        # replica 0 crashes; a health check (as after a group whose rollouts all failed) takes it out
        servers[0].up = False
        watcher.check_health()
        await until(lambda: replicas.up == [False, True])
        assert watcher.serving
        publish(tmp_path, 2)
        await until(lambda: policy.version == 2)
        assert servers[0].loads == [1] and servers[1].loads == [1, 2]  # the live one moves on alone
        # it comes back restarted, serving the start weights: it gets v2 before it takes rollouts again
        servers[0].served = 0
        servers[0].up = True
        told = len(changes)
        await until(lambda: replicas.up == [True, True])
        assert servers[0].served == 2 and watcher.recoveries == 1
        assert changes[told:] == [2]  # the orchestrator is told a replica is back (its dispatcher wakes)
        # every replica down: admission stops; the first back gets the newest published policy
        await all_down(servers, watcher)
        publish(tmp_path, 3)
        await asyncio.sleep(0.1)
        assert policy.version == 2  # nothing could load it
        servers[1].served, servers[1].up = 0, True
        await until(lambda: replicas.up == [False, True])
        assert policy.version == 3 and servers[1].served == 3
        # a replica that stays down past recovery_timeout_s while another serves does not end the run
        await asyncio.sleep(0.7)
        assert not task.done()
        # the last one up goes down too, and nothing comes back: the run ends with the recovery's error
        servers[1].up = False
        watcher.check_health()
        with pytest.raises(RunError, match="not healthy"):
            await asyncio.wait_for(task, 5.0)

    asyncio.run(main())
    assert changes[:2] == [1, 2]


def test_a_requeued_replica_is_followed_to_its_new_address(tmp_path):
    """SLURM requeued replica 0's job: it comes back on another node/port and advertises that; the watcher follows it
    there, loads the current policy, and new rollouts reach it through a runner built for the new address."""
    servers = [FakeServer("node1:8000"), FakeServer("node1:8001")]
    replicas, policy, built = Replicas(servers), Policy(), []

    def runner_for(url: str) -> ServerRunner:
        built.append(url)
        return ServerRunner(next(s for s in servers if s.base_url == url))

    runner = ReplicaRunner([ServerRunner(s) for s in servers], replicas, runner_for)
    advertised = [s.base_url for s in servers]
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0, addresses=lambda: list(advertised))

    async def main():
        async with watching(watcher):
            publish(tmp_path, 1)
            await until(lambda: policy.version == 1)
            servers[0].address, servers[0].served = "http://node2:8123", 0  # requeued: it starts elsewhere, on v0
            watcher.check_health()
            await until(lambda: replicas.up == [False, True])
            await asyncio.sleep(0.3)
            assert replicas.up == [False, True] and built == []  # nothing advertised yet: it waits at the old address
            advertised[0] = "http://node2:8123"  # the requeued job writes its address once it knows its port
            await until(lambda: replicas.up == [True, True])
            assert servers[0].base_url == "http://node2:8123" and servers[0].served == 1  # followed, current policy
            assert built == ["http://node2:8123"]
            results = await asyncio.gather(*(runner.run(i) for i in range(4)))
            assert all(isinstance(r[0], Rollout) for r in results) and len(runner.runners[0].tasks) == 2

    asyncio.run(main())


def test_a_replica_requeued_before_it_first_served_is_followed_at_start(tmp_path):
    """The orchestrator starts while replica 0's node is lost: its job is requeued before its server ever answered,
    and advertises its new address. The start's wait follows it there (as recovery does later), and rollouts built
    for the new address reach it; it does not wait out inference.startup_timeout_s at the old one."""
    servers = [FakeServer("node2:8000"), FakeServer("node3:8000")]
    replicas, built = Replicas(servers), []

    def runner_for(url: str) -> ServerRunner:
        built.append(url)
        return ServerRunner(next(s for s in servers if s.base_url == url))

    runner = ReplicaRunner([ServerRunner(s) for s in servers], replicas, runner_for)
    servers[0].address = "http://node1:8123"  # where the requeued job serves
    advertised = [None, servers[1].base_url]  # not yet written

    async def main():
        waiting = asyncio.ensure_future(served_policy(replicas, 3.0, lambda: list(advertised)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        advertised[0] = "http://node1:8123"
        policy = await asyncio.wait_for(waiting, 2.0)
        assert policy.version == 0 and replicas.up == [True, True] and servers[0].base_url == "http://node1:8123"
        assert built == ["http://node1:8123"]
        results = await asyncio.gather(*(runner.run(i) for i in range(4)))
        assert all(isinstance(r[0], Rollout) for r in results) and len(runner.runners[0].tasks) == 2

    asyncio.run(main())


def test_a_server_whose_workers_disagree_serves_the_oldest_version_they_serve():
    """One server of a prefill/decode pair restarted on the start model while the other serves v70: the router answers
    /collective_rpc with both (primerl.inference.pd_router). The pair counts as serving v0, so recovery loads the
    current version into both, where it once raised 'workers disagree' at every try and never came back (the chaos
    soak's --pd run); one unproven worker makes the whole server unproven."""
    from aiohttp import web

    answers = {"results": [0, 70]}

    async def collective_rpc(request: web.Request) -> web.Response:
        assert (await request.json())["method"] == "primerl_get_policy_version"
        return web.json_response(answers)

    async def main():
        async with (
            loopback_server({("POST", "/collective_rpc"): collective_rpc}) as url,
            InferenceClient(url) as client,
        ):
            assert await client.policy_version() == 0
            answers["results"] = [70, UNPROVEN]
            assert await client.policy_version() == UNPROVEN
            answers["results"] = [70, 70]
            assert await client.policy_version() == 70

    asyncio.run(main())


def test_weights_a_live_replica_keeps_refusing_end_the_run(tmp_path):
    servers, replicas, _, _ = replica_set(2)

    async def refuse(path, version, group=""):
        raise RuntimeError("primerl_load_weights failed (500): not a stable weight directory")

    servers[1].load_weights = refuse  # it answers /health, but will not take the weights
    watcher = Watcher(tmp_path, replicas, Policy(), 0.01, 0.5)
    publish(tmp_path, 1)

    async def main():
        with pytest.raises(RunError, match="3 times in a row.*not a stable weight directory"):
            await asyncio.wait_for(watcher.run(), 5.0)

    asyncio.run(main())
    assert replicas.up == [True, True]  # a refusal is not a crash: nobody was taken out


def test_replica_config_ports_and_errors():
    from primerl.config.inference import replica_urls
    from primerl.config.schema import RunConfig
    from primerl.config.validate import validate
    from primerl.inference.vllm_args import render_specs, replica_cores
    from primerl.launch.local import trainer_threads
    from primerl.utils.errors import ConfigError
    from primerl.utils.process import free_port

    cfg = RunConfig()
    cfg.inference.port, cfg.inference.replicas = 8100, 3
    assert replica_urls(cfg.inference) == [f"http://127.0.0.1:{p}" for p in (8100, 8101, 8102)]
    specs = render_specs(cfg, "/model", "cpu")
    assert [s.port for s in specs] == [8100, 8101, 8102]
    assert [s.args[s.args.index("--port") + 1] for s in specs] == ["8100", "8101", "8102"]
    # on CPU each replica's OpenMP threads get their own cores (vLLM's `auto` put all of them on one)
    binds = [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs]
    assert binds == replica_cores(3)
    if len(os.sched_getaffinity(0)) >= 2:
        assert binds[0] != binds[1]
    # taking turns with one server, the trainer gets every core (the server keeps every core but one: its API server
    # and the orchestrator need the other while it generates)
    assert trainer_threads(cfg) == max(1, len(os.sched_getaffinity(0)) - 1)
    cfg.launcher.colocate = True
    assert trainer_threads(cfg) == len(os.sched_getaffinity(0))
    cfg.launcher.colocate = False
    cfg.inference.pd.enabled = True  # three prefill/decode pairs: routers 8100-8102 would take the prefill ports
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == "inference.pd.prefill_port" and "share ports" in err.value.message
    cfg.inference.port = 8000
    validate(cfg)  # routers 8000-8002, prefill 8100-8102, decode 8200-8202
    first = free_port(count=4)
    for port in range(first, first + 4):  # all four are free
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_inference_jobs_on_several_nodes_advertise_their_replicas(tmp_path, monkeypatch):
    """launcher.inference_jobs=2 with 4 replicas: each SLURM job serves 2 and advertises its node in its own file;
    the orchestrator's job waits for both, and the replica URLs come from both (a job not yet advertised: None)."""
    import json

    from primerl.app import check
    from primerl.config.schema import RunConfig
    from primerl.config.validate import validate
    from primerl.launch.slurm_job import ModuleJob
    from primerl.transport.address import advertised_urls
    from primerl.utils.errors import ConfigError

    cfg = RunConfig()
    cfg.inference.replicas, cfg.launcher.inference_jobs = 3, 2
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert err.value.key == "launcher.inference_jobs"
    cfg.inference.replicas = 4
    assert advertised_urls(tmp_path, cfg.inference, 2) is None
    for index, (node, job_id) in enumerate([("node1", "11"), ("node3", "12")]):
        monkeypatch.setenv("SLURM_JOB_ID", job_id)
        monkeypatch.setenv("SLURMD_NODENAME", node)
        job = ModuleJob(
            "inference" if index == 0 else f"inference-{index}",
            "primerl.entrypoints.inference",
            [],
            str(tmp_path),
            inference_host="0.0.0.0",
            inference_port=9000 + 100 * index,
            inference_replicas=2,
            inference_index=index,
        )
        overrides = job._address_overrides()
        assert overrides == [
            f"inference.port={9000 + 100 * index}",
            "inference.replicas=2",
            "launcher.inference_jobs=1",
        ]
        # after the run's own overrides, as the job's process gets them: its share validates as one job
        check(["+experiment=reverse_text", "inference.replicas=4", "launcher.inference_jobs=2", *overrides])
        if index == 0:  # the second job has not started yet
            assert advertised_urls(tmp_path, cfg.inference, 2) == ["http://node1:9000", "http://node1:9001", None, None]
    assert advertised_urls(tmp_path, cfg.inference, 2) == [
        "http://node1:9000",
        "http://node1:9001",
        "http://node3:9100",
        "http://node3:9101",
    ]
    assert json.loads((tmp_path / "inference_address.1.json").read_text())["job_id"] == "12"
    orchestrator = ModuleJob(
        "orchestrator", "primerl.entrypoints.orchestrator", [], str(tmp_path), inference_job_ids=["11", "12"], wait_s=5
    )
    assert orchestrator._address_overrides() == ["inference.host=node1", "inference.port=9000"]
    stale = ModuleJob(
        "orchestrator", "primerl.entrypoints.orchestrator", [], str(tmp_path), inference_job_ids=["11", "99"], wait_s=1
    )
    with pytest.raises(RuntimeError, match="no address from inference job 99"):
        stale._address_overrides()  # an earlier attempt's address is not this job's


def test_prefill_and_decode_jobs_meet_through_their_addresses_and_the_routers_follow_a_moved_prefill_job(
    tmp_path, monkeypatch
):
    """With PD on SLURM, inference job 1 (of 2, 2 pairs each) is a prefill job and a decode job: the prefill job
    advertises its servers' first port, the decode job waits for it and points its routers there, both render pairs
    2 and 3 (their KV stores); when the prefill job is requeued elsewhere the decode job's routers follow it."""
    from primerl.app import check
    from primerl.inference.pd_router import PdRouter, follow_prefill
    from primerl.launch.slurm_job import ModuleJob
    from primerl.transport.address import advertised_urls, write_address

    run = ["+experiment=reverse_text", "launcher=slurm", "inference.pd.enabled=true", "inference.replicas=4"]
    run += ["inference.pd.kv_connector=ExampleConnector", "launcher.inference_jobs=2", f"output_dir={tmp_path}"]
    job = {"inference_host": "0.0.0.0", "inference_replicas": 2, "inference_index": 1, "wait_s": 5}
    monkeypatch.setenv("SLURM_JOB_ID", "21")
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    prefill_job = ModuleJob("prefill-1", "primerl.entrypoints.inference", [], str(tmp_path), pd_role="prefill", **job)
    prefill = check([*run, *prefill_job._address_overrides()]).inference
    assert (prefill.replicas, prefill.pd.role.value, prefill.pd.first_pair) == (2, "prefill", 2)
    monkeypatch.setenv("SLURM_JOB_ID", "22")
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    decode_job = ModuleJob(
        "decode-1", "primerl.entrypoints.inference", [], str(tmp_path), pd_role="decode", prefill_job_id="21", **job
    )
    decode = check([*run, *decode_job._address_overrides()]).inference
    assert (decode.pd.prefill_host, decode.pd.prefill_port) == ("node3", prefill.pd.prefill_port)
    assert (decode.pd.role.value, decode.pd.first_pair, decode.port) == ("decode", 2, decode.pd.decode_port + 2)
    assert advertised_urls(tmp_path, dataclasses.replace(decode, replicas=4), 2)[2:] == [
        f"http://node2:{decode.port}",
        f"http://node2:{decode.port + 1}",
    ]  # the routers, as inference job 1
    routers = [PdRouter(f"http://node3:{prefill.pd.prefill_port + i}", "", tmp_path) for i in range(2)]
    assert follow_prefill(routers, tmp_path, decode) == []  # where it was
    write_address(tmp_path, 1, "node1", 9500, "21", role="prefill")  # requeued onto node1
    assert follow_prefill(routers, tmp_path, decode) == ["http://node1:9500", "http://node1:9501"]
    assert [router.prefill_url for router in routers] == ["http://node1:9500", "http://node1:9501"]
    stale = ModuleJob(
        "decode-1", "primerl.entrypoints.inference", [], str(tmp_path), pd_role="decode", prefill_job_id="99", **job
    )
    with pytest.raises(RuntimeError, match="no address from prefill job 99"):
        stale._address_overrides()


def test_a_replica_that_keeps_its_old_weights_is_caught_loaded_again_and_taken_out_until_it_serves_them(tmp_path):
    servers, replicas, _, _ = replica_set(2)
    policy = Policy()
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0)

    async def main():
        async with watching(watcher):
            servers[1].keeps_old_weights = True  # answers every load, serves v0 still
            publish(tmp_path, 1)
            await until(lambda: replicas.up == [True, False])
            assert policy.version == 1 and servers[0].loads == [1]
            assert servers[1].loads[:2] == [1, 1] and watcher.mismatches >= 2  # loaded again once, then taken out
            await asyncio.sleep(0.2)
            assert (
                replicas.up == [True, False] and servers[1].paused
            )  # its recovery keeps failing the proof: out, paused
            servers[1].keeps_old_weights = False
            await until(lambda: replicas.up == [True, True])
            assert servers[1].served == 1 and not servers[1].paused

    asyncio.run(main())


def offer(run_dir, version: int, sender: str = "trainer") -> None:
    """Stand in for the trainer's collective offer of `version` (its fingerprint written at once, as if sent), by a
    sender whose rendezvous file is there unless `sender` is "gone"."""
    path = weights_path(run_dir, version)
    path.mkdir(parents=True)
    store = rendezvous_dir(run_dir) / f"{sender}.store"
    if sender != "gone":
        store.parent.mkdir(parents=True, exist_ok=True)
        store.touch()
    write_json(
        path / OFFER_FILE, {"id": f"offer-{version}-{time.monotonic_ns()}", "version": version, "store": str(store)}
    )
    write_fingerprint(path, fingerprint_of_version(version))
    (path / STABLE_MARKER).touch()


def answer(run_dir, version: int) -> dict | None:
    path = weights_path(run_dir, version)
    found = read_json_file(path / RECEIVERS_FILE)
    return found["groups"] if found and found["offer"] == read_json_file(path / OFFER_FILE)["id"] else None


def test_an_offer_whose_trainer_is_gone_waits_unanswered_for_the_one_its_successor_makes(caplog, tmp_path):
    """A trainer that resumed from a checkpoint before its newest (damaged) finds an offer of a later version by the
    trainer before it, whose rendezvous file it removed: nobody can send it, so it is not answered (answered, the
    replicas would wait on it and never take an older one); once the new trainer withdrew it, its own offer is taken."""
    servers, replicas, _, _ = replica_set(2)
    policy = Policy()
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0)

    async def main():
        async with watching(watcher):
            offer(tmp_path, 1)
            await until(lambda: policy.version == 1)
            offer(tmp_path, 3, sender="gone")
            await asyncio.sleep(0.3)
            assert answer(tmp_path, 3) is None and policy.version == 1 and servers[0].loads == [1]
            assert caplog.text.count("v3 was offered by a trainer that is gone") == 1  # said once, not at every poll
            shutil.rmtree(weights_path(tmp_path, 3))  # the new trainer withdraws it and offers its checkpoint's version
            offer(tmp_path, 2)
            await until(lambda: policy.version == 2)
            assert answer(tmp_path, 2) == {"r0-p0": 2, "r1-p0": 2} and replicas.up == [True, True]

    asyncio.run(main())


def test_collective_offers_are_answered_and_a_replica_back_from_a_restart_joins_the_next_one(tmp_path):
    """Every offer gets an answer (the trainer waits for it): the up replicas' groups, none when all serve it
    already. A restarted replica cannot read a version sent by collective: it joins the next offer, in a group of
    a new name, and is up once it took it."""
    servers, replicas, _, _ = replica_set(2)
    policy = Policy()
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0)

    async def main():
        task = asyncio.create_task(watcher.run())
        offer(tmp_path, 1)
        await until(lambda: policy.version == 1)
        assert answer(tmp_path, 1) == {"r0-p0": 2, "r1-p0": 2}
        servers[0].up = False  # killed; its process restarts on the start weights
        watcher.check_health()
        await until(lambda: replicas.up == [False, True])
        servers[0].served, servers[0].process, servers[0].up = 0, 1, True
        await asyncio.sleep(0.2)
        assert replicas.up == [False, True]  # v1 went by collective: nothing to load it from
        offer(tmp_path, 2)
        await until(lambda: replicas.up == [True, True])
        assert answer(tmp_path, 2) == {"r1-p0": 2, "r0-p1": 2} and policy.version == 2
        assert servers[0].served == 2 and servers[0].groups == ["r0-p0", "r0-p1"]
        # a trainer that restarted offers the version served again: answered, by nobody
        shutil.rmtree(weights_path(tmp_path, 2))
        offer(tmp_path, 2)
        await until(lambda: answer(tmp_path, 2) is not None)
        assert answer(tmp_path, 2) == {} and servers[1].loads == [1, 2]
        # every replica down: an offer waits unanswered until one is back to take it
        await all_down(servers, watcher)
        offer(tmp_path, 3)
        await asyncio.sleep(0.2)
        assert answer(tmp_path, 3) is None
        servers[1].served, servers[1].process, servers[1].up = 0, 1, True
        await until(lambda: replicas.up == [False, True])
        assert answer(tmp_path, 3) == {"r1-p1": 2} and policy.version == 3 and servers[1].served == 3
        # the one replica up dies as v4 is offered, before its group is named: the offer stays unanswered (no empty
        # answer), and the replica, back, takes it
        servers[1].up = False
        offer(tmp_path, 4)
        await until(lambda: not watcher.serving)
        assert answer(tmp_path, 4) is None
        servers[1].served, servers[1].process, servers[1].up = 0, 2, True
        await until(lambda: replicas.up == [False, True])
        assert answer(tmp_path, 4) == {"r1-p2": 2} and servers[1].served == 4
        # it dies again after taking v4, and no replica serves v4 any more: nothing can send it again, so the run
        # stops (a rerun resumes and the trainer offers it again) rather than wait for ever
        await all_down(servers, watcher)
        servers[1].served, servers[1].process, servers[1].up = 0, 3, True
        with pytest.raises(RunError, match="every inference replica lost policy v4, which went by collective"):
            await asyncio.wait_for(task, 5.0)

    asyncio.run(main())


def test_a_replica_slow_to_load_is_taken_out_and_the_others_serve_the_version_without_it(tmp_path, monkeypatch):
    """One replica's load runs far longer than the others': the version advances on the others (every replica up
    serves it), the slow one is out of routing meanwhile, and once its server finished the load on its own its
    recovery resumes it (a load cut on the orchestrator's side leaves the server paused) and takes it back."""
    monkeypatch.setattr(fanout, "STRAGGLER_MIN_S", 0.3)
    monkeypatch.setattr(fanout, "CHECK_EVERY_S", 0.02)
    servers, replicas, _, _ = replica_set(4)
    servers[3].load_s = 1.5
    policy = Policy()
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0)

    async def main():
        async with watching(watcher):
            started = time.monotonic()
            publish(tmp_path, 1)
            await until(lambda: policy.version == 1)
            assert time.monotonic() - started < 1.0 and replicas.up == [True, True, True, False]
            assert [server.served for server in servers[:3]] == [1, 1, 1] and servers[3].paused
            await until(lambda: replicas.up == [True] * 4)
            assert servers[3].served == 1 and not servers[3].paused and servers[3].loads == [1]

    asyncio.run(main())


def test_replicas_that_answer_each_versions_load_are_not_probed_until_the_versions_stop(tmp_path):
    """A load a replica answered is a sign of life, as a finished rollout is: while versions come more often than the
    health round, the replicas get no /health probe; once they stop, the round probes them again."""
    servers, replicas, _, _ = replica_set(3)
    policy = Policy()
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0)
    watcher.health = Health(replicas, every_s=0.3)

    async def main():
        async with watching(watcher):
            for version in range(1, 11):  # a version every 0.05 s for 0.5 s
                publish(tmp_path, version)
                await until(lambda v=version: policy.version == v)
                await asyncio.sleep(0.05)
            assert [server.probes for server in servers] == [0, 0, 0]
            assert [server.served for server in servers] == [10, 10, 10]
            await until(lambda: all(server.probes for server in servers), timeout_s=2.0)

    asyncio.run(main())


def test_a_replica_that_goes_silent_during_a_load_is_out_within_its_liveness_limit(tmp_path):
    """A replica's node is lost in the middle of a load: its server neither answers nor refuses anything more, so its
    load would wait out the whole HTTP timeout, and with it the version and the health round. The health round goes
    on during the load: the silent replica is marked down within its liveness limit, its load is cut, and the version
    advances on the other replica at once (not after the straggler cut's 10 s)."""
    servers, replicas, _, _ = replica_set(2)
    replicas.liveness = Liveness("inference replicas", 0.3, 0.3, tick_s=0.1)
    servers[0].load_s = 60.0
    policy = Policy()
    watcher = Watcher(tmp_path, replicas, policy, 0.01, 5.0)
    watcher.health = Health(replicas, every_s=0.1)

    async def main():
        async with watching(watcher) as task:
            publish(tmp_path, 1)
            await until(lambda: servers[0].paused)  # its load began
            lost = time.monotonic()
            servers[0].hung = True
            await until(lambda: policy.version == 1, timeout_s=5.0)
            assert time.monotonic() - lost < 3.0, "the version waited for the silent replica's load"
            assert replicas.up == [False, True] and servers[1].served == 1
            assert not task.done()  # the watcher goes on (the silent one's recovery waits for it)

    asyncio.run(main())


def test_a_watcher_stopped_after_answering_an_offer_still_takes_it(tmp_path):
    """The orchestrator ends (its watcher is cancelled) right after answering an offer: the loads it answered for
    still happen, or the trainer would wait for workers that never join."""
    servers, replicas, _, _ = replica_set(2)
    for server in servers:
        server.load_s = 0.5
    watcher = Watcher(tmp_path, replicas, Policy(), 0.01, 5.0)

    async def main():
        async with watching(watcher):
            offer(tmp_path, 1)
            await until(lambda: answer(tmp_path, 1) is not None)
        assert [server.served for server in servers] == [1, 1]

    asyncio.run(main())
