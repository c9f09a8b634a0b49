"""HTTP connections that prove, before anything else goes over them, that the run's server is at their other end
(primerl.transport.identity): the identity challenge is the first request on each new connection, and a connection
whose answer does not prove the run's key is closed with `NotOurServer` before the run's key is sent over it.

Two clients carry the key: httpx (the orchestrator's admin calls, the prefill/decode router) through
`verified_transport`, a network backend of httpcore's; and aiohttp (rollouts, primerl.envs.http_transport) through
`VerifiedConnector`, for the requests that carry the run's key (a judge's endpoint elsewhere is not the run's).
"""

import asyncio
import errno
import socket
import ssl
from typing import Any

import aiohappyeyeballs
import aiohttp
import httpcore
import httpx

from primerl.transport.identity import ChallengeAnswer, NotOurServer, challenge_request, new_challenge

CHALLENGE_TIMEOUT_S = 10.0  # a loaded server answers /health in well under a second


def _verify(stream, key: str, host: str, port: int) -> None:
    """The identity challenge over a new synchronous httpcore stream; raises httpcore.ConnectError, stream closed."""
    nonce, answer = new_challenge(), ChallengeAnswer()
    try:
        stream.write(challenge_request(host, port, nonce), timeout=CHALLENGE_TIMEOUT_S)
        while not answer.feed(stream.read(65536, timeout=CHALLENGE_TIMEOUT_S)):
            pass
        answer.check(key, nonce, port, f"http://{host}:{port}")
    except (NotOurServer, httpcore.NetworkError, httpcore.TimeoutException) as err:
        stream.close()
        raise httpcore.ConnectError(str(err)) from err


async def _verify_async(stream, key: str, host: str, port: int) -> None:
    """`_verify` over an asynchronous stream."""
    nonce, answer = new_challenge(), ChallengeAnswer()
    try:
        await stream.write(challenge_request(host, port, nonce), timeout=CHALLENGE_TIMEOUT_S)
        while not answer.feed(await stream.read(65536, timeout=CHALLENGE_TIMEOUT_S)):
            pass
        answer.check(key, nonce, port, f"http://{host}:{port}")
    except (NotOurServer, httpcore.NetworkError, httpcore.TimeoutException) as err:
        await stream.aclose()
        raise httpcore.ConnectError(str(err)) from err


class _VerifiedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, key: str, inner: httpcore.AsyncNetworkBackend):
        self.key, self.inner = key, inner

    async def connect_tcp(self, host: str, port: int, timeout=None, local_address=None, socket_options=None):
        stream = await self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        await _verify_async(stream, self.key, host, port)
        return stream

    async def connect_unix_socket(self, path: str, timeout=None, socket_options=None):
        return await self.inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _VerifiedSyncBackend(httpcore.NetworkBackend):
    def __init__(self, key: str, inner: httpcore.NetworkBackend):
        self.key, self.inner = key, inner

    def connect_tcp(self, host: str, port: int, timeout=None, local_address=None, socket_options=None):
        stream = self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        _verify(stream, self.key, host, port)
        return stream

    def connect_unix_socket(self, path: str, timeout=None, socket_options=None):
        return self.inner.connect_unix_socket(path, timeout, socket_options)

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def verified_transport(key: str | None, **kwargs: Any) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose every new connection proves the run's server holds `key` first (no key: plain)."""
    transport = httpx.AsyncHTTPTransport(**kwargs)
    if key:
        pool = transport._pool  # httpx builds its pool with the default backend and offers no argument for another
        pool._network_backend = _VerifiedBackend(key, pool._network_backend)
    return transport


def verified_sync_transport(key: str | None, **kwargs: Any) -> httpx.HTTPTransport:
    """`verified_transport` for a synchronous httpx client."""
    transport = httpx.HTTPTransport(**kwargs)
    if key:
        pool = transport._pool
        pool._network_backend = _VerifiedSyncBackend(key, pool._network_backend)
    return transport


class VerifiedConnector(aiohttp.TCPConnector):
    """aiohttp's TCP connector, proving each new connection of a request that carries `key` before the request.

    aiohttp 3.14's `_wrap_create_connection` with the challenge between the socket's connect and the transport's
    creation (the socket is then at the end of the answer, as a fresh one is at its start)."""

    def __init__(self, key: str | None, **kwargs: Any):
        super().__init__(**kwargs)
        self.authorization = f"Bearer {key}" if key else None

    async def _wrap_create_connection(
        self, *args: Any, addr_infos: list, req: aiohttp.ClientRequest, timeout: aiohttp.ClientTimeout, **kwargs: Any
    ):
        if self.authorization is None or req.headers.get("Authorization") != self.authorization:
            return await super()._wrap_create_connection(
                *args, addr_infos=addr_infos, req=req, timeout=timeout, **kwargs
            )
        client_error = kwargs.pop("client_error", aiohttp.ClientConnectorError)
        try:
            sock = await asyncio.wait_for(
                aiohappyeyeballs.start_connection(addr_infos=addr_infos, loop=self._loop), timeout.sock_connect
            )
            await self._challenge(sock, req.url.host or "", req.url.port or 80)
            return await self._loop.create_connection(*args, **kwargs, sock=sock)
        except (NotOurServer, OSError, ssl.SSLError) as err:
            raise client_error(req.connection_key, OSError(errno.EPROTO, str(err))) from err

    async def _challenge(self, sock: socket.socket, host: str, port: int) -> None:
        nonce, answer = new_challenge(), ChallengeAnswer()
        try:
            async with asyncio.timeout(CHALLENGE_TIMEOUT_S):
                await self._loop.sock_sendall(sock, challenge_request(host, port, nonce))
                while not answer.feed(await self._loop.sock_recv(sock, 65536)):
                    pass
            answer.check(self.authorization.removeprefix("Bearer "), nonce, port, f"http://{host}:{port}")
        except BaseException:
            sock.close()
            raise
