"""Live metrics for cluster monitoring: a process's latest values, served in Prometheus' text format.

`LiveMetrics` serves `GET /metrics` from a thread of its own (the process's work never waits on a scrape), on the host
and port it is given, and answers 401 to a request without `Authorization: Bearer <token>` when it has a token
(compared in constant time). Each value `key` is the gauge `primerl_<key>` (every character outside `[a-zA-Z0-9_]`
becomes `_`: `reward/mean` is `primerl_reward_mean`), labelled with the process's own labels (run, process, ...) and
the value's own (a replica). A value set again replaces the last one; a value that is not finite is served as
Prometheus' NaN or +/-Inf, as the text format allows.
"""

import hmac
import re
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "primerl_"
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


def gauge_name(key: str) -> str:
    return PREFIX + _NOT_A_NAME.sub("_", key)


class _Collector:
    """What a scrape reads: the latest value of each (gauge, extra labels), under the lock."""

    def __init__(self, labels: Mapping[str, str]):
        self.labels = dict(labels)
        self.values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.lock:
            snapshot = {name: dict(series) for name, series in self.values.items()}
        for name, series in sorted(snapshot.items()):
            extra_names = [k for k, _ in next(iter(series))]
            family = GaugeMetricFamily(
                name, f"primerl {name.removeprefix(PREFIX)}", labels=[*self.labels, *extra_names]
            )
            for extra, value in series.items():
                family.add_metric([*self.labels.values(), *(v for _, v in extra)], value)
            yield family


class LiveMetrics:
    """The endpoint of one process. `set(values)` from any thread; `close()` stops serving."""

    def __init__(self, host: str, port: int, token: str | None, labels: Mapping[str, str]):
        self._collector = _Collector(labels)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        expected = f"Bearer {token}".encode() if token else None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                given = self.headers.get("Authorization", "").encode()
                if expected is not None and not hmac.compare_digest(given, expected):
                    self._answer(401, b"a bearer token is required\n", "text/plain")
                elif self.path.split("?")[0] != "/metrics":
                    self._answer(404, b"only /metrics is served\n", "text/plain")
                else:
                    self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # a scrape every few seconds is not news
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"http://{host}:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, name="primerl-metrics", daemon=True)
        self._thread.start()

    def set(self, values: Mapping[str, float], **labels: str) -> None:
        """The latest value of each key (numbers only; others are skipped), with `labels` beside the process's."""
        extra = tuple(sorted(labels.items()))
        with self._collector.lock:
            for key, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._collector.values.setdefault(gauge_name(key), {})[extra] = float(value)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
