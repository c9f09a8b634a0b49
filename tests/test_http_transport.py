"""The aiohttp transport under verifiers' OpenAI clients, against a real HTTP server on 127.0.0.1."""

import asyncio
import gzip
import json
import socket

import httpx
import openai
import pytest
from aiohttp import web
from verifiers.v1.clients import base as verifiers_clients

from primerl.envs.http_transport import AiohttpTransport, use_aiohttp_for_openai_clients
from primerl.envs.verifiers_env import TRANSIENT_RETRIES
from tests.loopback import loopback_server


async def echo(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"path": request.path, "body": body, "auth": request.headers.get("Authorization")})


async def gzipped(request: web.Request) -> web.Response:
    payload = gzip.compress(json.dumps({"id": "x", "n": 3}).encode())
    return web.Response(body=payload, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})


async def streamed(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    for i in range(3):
        await response.write(f"chunk{i};".encode())
        await asyncio.sleep(0.01)
    await response.write_eof()
    return response


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(1)
    return web.json_response({})


async def hang_up(request: web.Request) -> web.Response:
    request.transport.close()  # the server dies mid-request
    await asyncio.sleep(1)
    return web.json_response({})


ROUTES = {
    ("POST", "/v1/echo"): echo,
    ("GET", "/v1/gzip"): gzipped,
    ("GET", "/v1/stream"): streamed,
    ("POST", "/v1/slow"): slow,
    ("POST", "/v1/hang_up"): hang_up,
}


async def with_server(test) -> None:
    async with (
        loopback_server(ROUTES) as url,
        httpx.AsyncClient(transport=AiohttpTransport(httpx.Limits(max_connections=8)), timeout=2.0) as http,
    ):
        await test(f"{url}/v1", http)


def sdk(base_url: str, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="k", max_retries=0, http_client=http)


def test_requests_and_responses_pass_through_whole():
    async def test(base_url, http):
        client = sdk(base_url, http)
        replies = await asyncio.gather(
            *(client.post("/echo", cast_to=object, body={"i": i, "text": "héllo"}) for i in range(20))
        )
        assert [r["body"] for r in replies] == [{"i": i, "text": "héllo"} for i in range(20)]
        assert {r["auth"] for r in replies} == {"Bearer k"} and replies[0]["path"] == "/v1/echo"
        assert (await http.get(f"{base_url}/gzip")).json() == {"id": "x", "n": 3}  # httpx decodes, as usual
        async with http.stream("GET", f"{base_url}/stream") as response:
            assert b"".join([chunk async for chunk in response.aiter_bytes()]) == b"chunk0;chunk1;chunk2;"

    asyncio.run(with_server(test))


def test_failures_are_classified_as_over_httpx():
    """A dead server is a connection error (which the transient-retry rule names), a slow one a timeout."""
    rule = TRANSIENT_RETRIES["rules"][0]["message"]

    async def test(base_url, http):
        client = sdk(base_url, http)
        with pytest.raises(openai.APITimeoutError) as timed_out:
            await client.post("/slow", cast_to=object, body={}, options={"timeout": 0.3})
        assert isinstance(timed_out.value.__cause__, httpx.ReadTimeout)  # connected; the answer was late
        with pytest.raises(openai.APIConnectionError) as hung_up:
            await client.post("/hang_up", cast_to=object, body={})
        assert not isinstance(hung_up.value, openai.APITimeoutError) and rule in str(hung_up.value)

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        with pytest.raises(openai.APIConnectionError) as refused:
            await sdk(dead, http).post("/echo", cast_to=object, body={})
        assert not isinstance(refused.value, openai.APITimeoutError) and rule in str(refused.value)
        assert isinstance(refused.value.__cause__, httpx.ConnectError)

    asyncio.run(with_server(test))


def test_verifiers_openai_clients_are_built_on_it():
    from verifiers.v1 import TrainClientConfig

    use_aiohttp_for_openai_clients()
    use_aiohttp_for_openai_clients()  # idempotent
    config = TrainClientConfig(base_url="http://127.0.0.1:1/v1", api_key_var="PRIMERL_TEST_KEY")
    http = verifiers_clients.build_async_openai(config)._client
    assert isinstance(http._transport, AiohttpTransport)
    assert http.timeout == httpx.Timeout(**config.timeout.model_dump())


def test_an_env_worker_answers_a_malformed_frame_with_an_error_and_keeps_serving(tmp_path):
    """A `run` frame whose payload is not msgpack gets a failed reply (verifiers' error answer), not silence: the
    client waits for every request's reply."""
    import msgpack
    from verifiers.v1.utils.loaders import resolve_env_config

    from primerl.app import check
    from primerl.envs.verifiers_env import env_config
    from primerl.envs.worker_process import RolloutsServer

    config = resolve_env_config(env_config(check(["+experiment=reverse_text"]).env))
    server = RolloutsServer(config, address=f"ipc://{tmp_path}/worker.sock")
    sent = []

    async def send_multipart(frames, copy=True):
        sent.append(frames)

    server.frontend.send_multipart = send_multipart
    try:
        asyncio.run(server._handle(b"client", b"r1", b"run", b"\xc1 not msgpack"))
        asyncio.run(server._handle(b"client", b"r2", b"health", msgpack.packb({})))
    finally:
        server.frontend.close(linger=0)
    (_, request, kind, data), (_, health, _, answer) = sent
    assert (request, kind, health) == (b"r1", b"reply", b"r2")
    reply = msgpack.unpackb(data, raw=False)
    assert reply["success"] is False and reply["error"] and msgpack.unpackb(answer, raw=False)["success"] is True
    assert "r1" not in server._running
