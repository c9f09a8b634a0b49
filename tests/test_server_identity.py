"""A second run on an address where something already serves (another run's server, with the default port) is refused
at once with one line, and no process of a run takes a server of another run for its own (primerl.transport.identity).
A stand-in server answering 200 on every path plays the other run's server, and another user's process on a port
the run's server left (it forges the run's server id, which anyone can compute): no client of the run sends it the
key, because no connection of it proves the key."""

import asyncio
import http.server
import json
import threading

import pytest

from primerl.inference.guard import InferenceGuard
from primerl.orchestrator.inference_client import InferenceClient
from primerl.transport.identity import SERVER_ID_ENV, SERVER_ID_HEADER, server_identity
from primerl.utils.process import free_port, port_taken
from tests.conftest import run_module


@pytest.fixture
def other_server():
    """(port, set_identity, seen): an HTTP server on 127.0.0.1 answering 200 to everything (`{"results": ["999"]}`
    to a POST), with the identity header set to whatever `set_identity` last gave (none at first); `seen` collects
    the Authorization header of every request it got."""
    identity: list[str | None] = [None]
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self, body: bytes) -> None:
            seen.append(self.headers.get("Authorization", ""))
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            if identity[0]:
                self.send_header(SERVER_ID_HEADER, identity[0])
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(b"")

        def do_POST(self):
            self.answer(json.dumps({"results": ["999"]}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], lambda value: identity.__setitem__(0, value), seen
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
    port, set_identity, _ = other_server
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


@pytest.mark.parametrize("module", ["primerl.train", "primerl.entrypoints.inference"])
def test_a_second_run_on_a_taken_port_is_refused_at_once(other_server, tmp_path, module):
    port, _, _ = other_server
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


def test_no_client_sends_the_key_to_a_server_that_does_not_prove_it_holds_it(other_server, tmp_path, monkeypatch):
    """Another user's process on the port of a server that restarts, forging the run's id: the orchestrator's
    client, the prefill/decode router and the rollouts' HTTP see no server there and send it no key; the run's own
    server (the guard, with the key) proves itself on every connection and is used."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from primerl.envs.http_transport import AiohttpTransport
    from primerl.inference.guard import API_KEY_ENV
    from primerl.inference.pd_router import start_router
    from primerl.utils.wait import wait_until

    key, port, set_identity, seen = "run-key-1234", *other_server
    ours = server_identity(tmp_path)
    set_identity(ours)  # anyone can compute it from the run directory
    foreign = f"http://127.0.0.1:{port}"

    async def orchestrator_and_rollouts():
        async with InferenceClient(foreign, key, server_id=ours) as client:
            health = await client.health()
            with pytest.raises(httpx.ConnectError, match="does not prove the run's key"):
                await client.policy_version()
        transport = AiohttpTransport(httpx.Limits(), key)
        try:
            async with httpx.AsyncClient(transport=transport) as http:
                with pytest.raises(httpx.ConnectError, match="does not prove the run's key"):
                    await http.post(
                        f"{foreign}/inference/v1/generate", json={}, headers={"Authorization": f"Bearer {key}"}
                    )
        finally:
            await transport.aclose()
        return health

    assert asyncio.run(orchestrator_and_rollouts()) is False

    monkeypatch.setenv(API_KEY_ENV, key)  # the run's own server: the guard with the run's key
    monkeypatch.setenv(SERVER_ID_ENV, ours)

    async def rpc(request):
        return JSONResponse({"results": ["7"]})

    app = InferenceGuard(Starlette(routes=[Route("/collective_rpc", rpc, methods=["POST"]), Route("/health", rpc)]))
    real_port = free_port()
    real = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=real_port, log_level="warning"))
    threading.Thread(target=real.run, daemon=True).start()
    wait_until(lambda: real.started, "the stand-in server", timeout_s=30)
    env = {API_KEY_ENV: key, SERVER_ID_ENV: ours}
    router_port = free_port()
    router = start_router("127.0.0.1", router_port, foreign, foreign, tmp_path / "kv", env)
    try:
        auth = {"Authorization": f"Bearer {key}"}
        through = httpx.post(f"http://127.0.0.1:{router_port}/inference/v1/generate", json={}, headers=auth, timeout=30)
        assert through.status_code >= 500  # the router found no proven server behind it
        assert httpx.get(f"http://127.0.0.1:{router_port}/health", timeout=30).status_code == 503

        async def own():
            async with InferenceClient(f"http://127.0.0.1:{real_port}", key, server_id=ours) as client:
                return await client.healthy(), await client.policy_version()

        assert asyncio.run(own()) == (True, 7)
    finally:
        router.stop()
        real.should_exit = True
    assert seen and not any(key in header for header in seen), seen  # the foreigner never got the key
