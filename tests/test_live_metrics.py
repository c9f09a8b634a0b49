"""Live metrics in Prometheus' format (primerl.utils.prometheus, primerl.metrics.serve_live_metrics): the endpoint's
token, names, labels and values as prometheus_client's own parser reads them, rows appended by the process, and a
real Prometheus scraping it. A whole run scraped by Prometheus is in tests/test_rl_e2e.py."""

import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from primerl import metrics
from primerl.app import check
from primerl.config.ledger import PrometheusConfig
from primerl.utils.errors import ConfigError
from primerl.utils.process import free_port
from primerl.utils.prometheus import LiveMetrics
from tests.prometheus_server import prometheus, prometheus_binary, query


def _samples(text: str) -> dict[tuple, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_endpoint_serves_the_latest_values_to_a_scrape_with_the_token_only():
    live = LiveMetrics("127.0.0.1", free_port(), "s3cret", {"run": "/runs/a", "process": "orchestrator"})
    try:
        live.set({"reward/mean": 0.25, "inflight/rollouts": 12, "note": "text is skipped"})
        live.set({"reward/mean": 0.5, "loss": float("nan")})  # the latest value replaces the last
        live.set({"inference/up": 1.0}, port="8000")
        live.set({"inference/up": 0.0}, port="8001")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert httpx.get(live.address, headers=headers).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(live.address.replace("/metrics", "/other"), headers=auth).status_code == 404
        answer = httpx.get(live.address, headers=auth)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        found = _samples(answer.text)
        own = (("process", "orchestrator"), ("run", "/runs/a"))
        assert found[("primerl_reward_mean", own)] == 0.5
        assert found[("primerl_inflight_rollouts", own)] == 12
        assert math.isnan(found[("primerl_loss", own)])
        assert found[("primerl_inference_up", (("port", "8000"), *own))] == 1.0
        assert found[("primerl_inference_up", (("port", "8001"), *own))] == 0.0
        assert not any(name == "primerl_note" for name, _ in found)
    finally:
        live.close()


def test_a_process_serves_the_rows_it_appends_and_a_taken_port_only_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRIMERL_METRICS_TOKEN", "scrape-token")  # wins over the run's key
    monkeypatch.setattr(metrics, "_live", None)
    port = free_port(count=3)
    live = metrics.serve_live_metrics(PrometheusConfig(port=port), metrics.TRAINER, tmp_path, "exp", "run-key")
    try:
        assert live.address == f"http://127.0.0.1:{port + 1}/metrics"  # the trainer's offset
        metrics.append_metrics(tmp_path, metrics.TRAINER, 3, {"loss": -0.5})
        metrics.append_metrics(tmp_path, metrics.EVAL, 2, {"env/reward_mean": 0.75})  # another process's row
        assert httpx.get(live.address, headers={"Authorization": "Bearer run-key"}).status_code == 401
        text = httpx.get(live.address, headers={"Authorization": "Bearer scrape-token"}).text
        labels = (("experiment", "exp"), ("process", "trainer"), ("run", str(tmp_path.resolve())))
        found = _samples(text)
        assert found[("primerl_loss", labels)] == -0.5 and found[("primerl_step", labels)] == 3
        assert found[("primerl_eval_env_reward_mean", labels)] == 0.75 and found[("primerl_eval_step", labels)] == 2
        assert metrics.read_metrics(tmp_path, metrics.TRAINER)[0]["loss"] == -0.5  # the row is written as before
        again = metrics.serve_live_metrics(PrometheusConfig(port=port), metrics.TRAINER, tmp_path, "exp", None)
        assert again is None and "live metrics not served" in caplog.text  # its port is taken: a warning
    finally:
        live.close()
        metrics._live = None


def test_a_scrape_from_another_host_needs_a_token(monkeypatch):
    monkeypatch.delenv("PRIMERL_METRICS_TOKEN", raising=False)
    monkeypatch.delenv("PRIMERL_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="ledger.prometheus.host: 0.0.0.0 is not a loopback address"):
        check(["+experiment=reverse_text", "ledger.prometheus.port=9400", "ledger.prometheus.host=0.0.0.0"])
    monkeypatch.setenv("PRIMERL_METRICS_TOKEN", "t")
    check(["+experiment=reverse_text", "ledger.prometheus.port=9400", "ledger.prometheus.host=0.0.0.0"])


@pytest.mark.skipif(prometheus_binary() is None, reason="no prometheus binary (make test unpacks Debian's into .venv)")
def test_a_real_prometheus_scrapes_the_endpoint_with_its_token(tmp_path):
    live = LiveMetrics("127.0.0.1", free_port(), "tok", {"run": "r", "process": "orchestrator"})
    try:
        live.set({"reward/mean": 0.625})
        with prometheus(tmp_path / "prom", [live.address.split("/")[2]], "tok") as url:
            for _ in range(100):
                found = query(url, 'primerl_reward_mean{process="orchestrator"}')
                if found:
                    break
                time.sleep(0.2)
            assert [(r["metric"]["run"], float(r["value"][1])) for r in found] == [("r", 0.625)]
            assert [float(r["value"][1]) for r in query(url, 'up{job="primerl"}')] == [1.0]
    finally:
        live.close()
