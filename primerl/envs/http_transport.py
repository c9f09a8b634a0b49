"""An httpx transport over aiohttp, for verifiers' OpenAI clients in the process that runs rollouts.

Why: the train client talks to vLLM through `openai.AsyncOpenAI` over httpx, and httpcore 1.0.9's connection pool
rescans every connection, probing each socket, for every queued request (encode/httpcore#1035, open). With a batch
of rollouts in flight that was ~40% of the orchestrator's CPU in a profile of `benchmarks/inference.py`, taken
from the cores vLLM needs. aiohttp's connector hands out connections in O(1).

Why our own and not `openai.DefaultAioHttpClient` (package httpx-aiohttp 0.2): that one maps every aiohttp
connection error, a refused connection included, to `httpx.ConnectTimeout`, so the SDK reports "Request timed out."
for a dead server and our transient-error retry rule ("Connection error", primerl/envs/verifiers_env.py) never fires.
Here only timeouts are timeouts: aiohttp timeouts -> httpx timeouts, a failed connect -> `httpx.ConnectError`, any
other transport failure -> `httpx.ReadError`; the SDK then says "Request timed out." or "Connection error." as it
does over httpcore.

verifiers builds the SDK's HTTP client in `clients.base.build_async_httpx` (train client and judges), so that is
where it goes in, with verifiers' own timeouts and connection limits. Every new connection of a request that carries
the run's key (`API_KEY_VAR`) first proves that the run's server is at its other end (primerl.transport.verified).
"""

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import aiohttp
import httpx
import verifiers.v1.clients.base as verifiers_clients

from primerl.envs.episode_journal import JOURNALS, Turn, digest, strip_episode
from primerl.transport.verified import VerifiedConnector
from primerl.transport.weights import POLICY_VERSION_HEADER

API_KEY_VAR = "PRIMERL_INFERENCE_API_KEY"  # verifiers' train client reads the server's key from this variable

# Idle connections are reused for at most this long: well under vLLM's (uvicorn's) 5 s keep-alive
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). verifiers' limits say 5 s too, and a request sent on a connection the server is
# closing at that moment fails as "Connection error.", and rollouts that idled together (waiting for a batch cut) would
# fail together: the likely cause of the bursts (41, then 10 rollouts) in the reverse_text run of 2026-12-03.
KEEPALIVE_S = 2.0


@contextmanager
def httpx_errors(request: httpx.Request | None) -> Iterator[None]:
    """Re-raise aiohttp/socket failures as the httpx exceptions the OpenAI SDK (and the orchestrator's admin calls,
    `request` None) classify."""
    try:
        yield
    except TimeoutError as err:  # aiohttp's timeout errors subclass it
        kind = httpx.ConnectTimeout if isinstance(err, aiohttp.ConnectionTimeoutError) else httpx.ReadTimeout
        raise kind(str(err) or type(err).__name__, request=request) from err
    except aiohttp.ClientConnectorError as err:
        raise httpx.ConnectError(str(err), request=request) from err
    except (aiohttp.ClientError, OSError) as err:
        raise httpx.ReadError(str(err) or type(err).__name__, request=request) from err


class AiohttpResponseStream(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request):
        self.response, self.request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with httpx_errors(self.request):
            async for chunk in self.response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        self.response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends httpx requests over one aiohttp session, opened on first use (on the loop that uses it).

    Invariant: bodies go through undecoded (httpx decodes them, as over its own transport); redirects are
    httpx's business, so aiohttp never follows one.
    """

    def __init__(self, limits: httpx.Limits, key: str | None = None):
        self.limits, self.key = limits, key
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            connector = VerifiedConnector(
                self.key,
                limit=self.limits.max_connections or 0,  # 0: no limit, as httpx's None
                keepalive_timeout=min(self.limits.keepalive_expiry or KEEPALIVE_S, KEEPALIVE_S),
            )
            self.session = aiohttp.ClientSession(  # cookies and decoding stay httpx's
                connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self.session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        body, journal = strip_episode(body)
        if journal is None:
            return await self._send(request, body)
        request_digest = digest(body)
        if (turn := JOURNALS.recorded(journal, request_digest)) is not None:
            return _journaled(request, turn)
        response = await self._send(request, body)
        answer = await response.aread()
        if response.status_code == 200:
            version = response.headers.get(POLICY_VERSION_HEADER, "")  # a server that is not primerl's: none
            JOURNALS.record(journal, request_digest, Turn(answer, int(version) if version.isdigit() else None))
        return response

    async def _send(self, request: httpx.Request, body: bytes) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        headers = [
            (k, str(len(body)) if k.lower() == "content-length" else v)  # the body may be a journaled one, stripped
            for k, v in request.headers.multi_items()
            if k.lower() != "transfer-encoding"
        ]
        with httpx_errors(request):
            response = await self._session().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeout.get("pool"),
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                ),
            )
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=AiohttpResponseStream(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


def _journaled(request: httpx.Request, turn: Turn) -> httpx.Response:
    """A turn's recorded answer, as the server gave it (primerl.envs.episode_journal)."""
    headers = {"content-type": "application/json"}
    if turn.version is not None:
        headers[POLICY_VERSION_HEADER] = str(turn.version)
    return httpx.Response(200, headers=headers, content=turn.body, request=request)


def build_aiohttp_client(config) -> httpx.AsyncClient:
    """verifiers' `build_async_httpx`, on the aiohttp transport."""
    limits = verifiers_clients.DEFAULT_LIMITS
    key = os.environ.get(API_KEY_VAR)
    transport = AiohttpTransport(limits, key if key and key != "EMPTY" else None)
    return httpx.AsyncClient(timeout=httpx.Timeout(**config.timeout.model_dump()), limits=limits, transport=transport)


def use_aiohttp_for_openai_clients() -> None:
    """Idempotent. Clients built before the call keep their transport."""
    verifiers_clients.build_async_httpx = build_aiohttp_client
