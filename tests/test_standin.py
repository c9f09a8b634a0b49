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
