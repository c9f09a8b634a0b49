"""The stand-in inference server (benchmarks/standin_server.py) speaks the routes primerl uses: the real orchestrator
process runs a few steps against two of them, with weight updates and its rollouts in an env worker, as it does
against vLLM. The capacity figures
measured with it are in benchmarks/results.md, not asserted here."""

import httpx

from benchmarks.capacity import drive, orchestrator_overrides, start_standins
from primerl.metrics import ORCHESTRATOR, OrchestratorMetric, read_metrics
from primerl.utils.process import free_port


def test_the_orchestrator_runs_against_stand_in_servers(cache_dir, tmp_path):
    run, port, steps = tmp_path / "run", free_port(count=2), 4
    run.mkdir()
    servers = start_standins(run, port, 2, None, "--tokens", "6")
    try:
        overrides = [*orchestrator_overrides(run, port, 2, steps, 32, workers=1), f"cache_dir={cache_dir}"]
        drive(run, overrides, steps, None, timeout_s=300)
        served = [
            httpx.post(
                f"http://127.0.0.1:{port + i}/collective_rpc", json={"method": "primerl_get_policy_version"}
            ).json()["results"][0]
            for i in range(2)
        ]
    finally:
        servers.terminate()
        servers.wait(timeout=30)
    rows = read_metrics(run, ORCHESTRATOR)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r[OrchestratorMetric.ROLLOUTS_FAILED] == 0 for r in rows)
    assert sum(r[OrchestratorMetric.ROLLOUTS_OK] for r in rows) >= steps * 32
    assert rows[-1][OrchestratorMetric.POLICY_VERSION] >= steps - 2  # weight updates reached the replicas
    assert min(served) >= 1 and rows[-1][OrchestratorMetric.REPLICAS_UP] == 2


def test_a_collective_load_may_take_as_long_as_its_transfer_limits_allow_not_the_clients_default(tmp_path):
    """A worker may wait 2 x weights.timeout_s to join, for each bucket and for the fingerprint: the load's deadline
    comes from the offer (a client default of 1 s, a load of 3 s: it is served), while a load of files keeps the
    default (the same 3 s load times out)."""
    import asyncio
    import json

    from primerl.orchestrator.inference_client import InferenceClient
    from primerl.transport.atomic import atomic_dir
    from primerl.transport.run_dir import weights_path
    from primerl.transport.weights import OFFER_FILE, write_fingerprint

    port = free_port()
    servers = start_standins(tmp_path, port, 1, None, "--load-s", "3")
    offered, files = weights_path(tmp_path, 1), weights_path(tmp_path, 2)
    with atomic_dir(offered) as staging:
        (staging / OFFER_FILE).write_text(json.dumps({"timeout_s": 5, "buckets": [[{"name": "w"}]]}))
        write_fingerprint(staging, "f1")
    with atomic_dir(files) as staging:
        write_fingerprint(staging, "f2")

    async def loads():
        async with InferenceClient(f"http://127.0.0.1:{port}", timeout_s=1.0) as client:
            await client.wait_healthy(30)
            loaded = await client.load_weights(offered, 1, "r0-group")
            try:
                await client.load_weights(files, 2)
            except httpx.TimeoutException:
                return loaded, "timed out"
            return loaded, "loaded"

    try:
        loaded, files_load = asyncio.run(loads())
    finally:
        servers.terminate()
        servers.wait(timeout=30)
    assert loaded.fingerprint == "f1" and loaded.seconds > 2.5 and files_load == "timed out"
