"""A real Prometheus server for tests: Debian's `prometheus`, which `make test` unpacks into .venv/bin (no root), or
one on PATH. It scrapes the targets it is given every second, on loopback, presenting a bearer token."""

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from primerl.utils.process import free_port

VENV_BINARY = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "prometheus"


def prometheus_binary() -> str | None:
    return str(VENV_BINARY) if VENV_BINARY.exists() else shutil.which("prometheus")


@contextlib.contextmanager
def prometheus(folder: Path, targets: list[str], token: str) -> Iterator[str]:
    """A Prometheus scraping `targets` (host:port) every second with `token`; yields its base URL."""
    folder.mkdir(parents=True, exist_ok=True)
    token_file = folder / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    config = folder / "prometheus.yml"
    quoted = ", ".join(f"'{t}'" for t in targets)
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: primerl\n"
        f"    authorization: {{type: Bearer, credentials_file: {token_file}}}\n"
        f"    static_configs: [{{targets: [{quoted}]}}]\n"
    )
    port = free_port()
    with open(folder / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [
                prometheus_binary(),
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (folder / "prometheus.log").read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def query(url: str, promql: str) -> list[dict]:
    """The result vector of an instant PromQL query: [{"metric": {labels}, "value": [time, "value"]}, ...]."""
    answer = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]
