"""A second run on an address where something already serves (another run's server, with the default port) is refused
at once with one line, and no process of a run takes a server of another run for its own (primerl.transport.identity).
A stand-in server answering 200 on every path plays the other run's server."""

import asyncio
import http.server
import threading

import pytest

from primerl.inference.guard import InferenceGuard
from primerl.orchestrator.inference_client import InferenceClient
from primerl.transport.identity import SERVER_ID_ENV, SERVER_ID_HEADER, server_identity
from primerl.utils.process import free_port, port_taken
from tests.conftest import run_module


@pytest.fixture
def other_server():
    """(port, set_identity): an HTTP server on 127.0.0.1 answering 200 to everything, with the identity header set
    to whatever `set_identity` last gave (none at first)."""
    identity: list[str | None] = [None]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            if identity[0]:
                self.send_header(SERVER_ID_HEADER, identity[0])
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], lambda value: identity.__setitem__(0, value)
    server.shutdown()
    server.server_close()


def test_the_guard_marks_every_response_with_the_runs_server_id(monkeypatch):
    monkeypatch.setenv(SERVER_ID_ENV, "abc123")
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def collect(message):
        sent.append(message)

    async def main():
        guard = InferenceGuard(app)
        for path in ("/health", "/no-such-route"):  # the app's answer, and the guard's own 404
            await guard({"type": "http", "path": path, "headers": []}, None, collect)

    asyncio.run(main())
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [200, 404]
    assert all((SERVER_ID_HEADER.encode(), b"abc123") in m["headers"] for m in starts)


def test_a_client_takes_only_its_own_runs_server(other_server, tmp_path):
    port, set_identity = other_server
    ours = server_identity(tmp_path)

    async def health():
        async with InferenceClient(f"http://127.0.0.1:{port}", server_id=ours) as client:
            return await client.health(), await client.healthy()

    assert asyncio.run(health()) == (False, False)  # a server without the header: not ours
    set_identity(server_identity(tmp_path / "another-run"))
    assert asyncio.run(health()) == (False, False)
    set_identity(ours)
    assert asyncio.run(health()) == (True, True)
    assert server_identity(tmp_path) == server_identity(tmp_path / "." / "x" / "..")  # the resolved run directory


@pytest.mark.parametrize("module", ["primerl.train", "primerl.inference"])
def test_a_second_run_on_a_taken_port_is_refused_at_once(other_server, tmp_path, module):
    port, _ = other_server
    assert port_taken("127.0.0.1", port) and not port_taken("127.0.0.1", free_port())
    result = run_module(
        module,
        "+experiment=reverse_text",
        "sft.enabled=false",
        f"inference.port={port}",
        f"hydra.run.dir={tmp_path}",
        "ledger.enabled=false",
        timeout=120,
    )
    errors = [line for line in result.stderr.strip().splitlines() if "already in use" in line]
    assert result.returncode == (2 if module == "primerl.train" else 1), result.stderr[-2000:]
    assert len(errors) == 1 and f"127.0.0.1:{port} is already in use" in errors[0], result.stderr[-2000:]
    if module == "primerl.train":  # a config error: the one line is all it prints
        assert result.stderr.strip().startswith("primerl: config error: inference.port: ")
        assert len(result.stderr.strip().splitlines()) == 1
