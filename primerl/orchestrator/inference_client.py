"""The orchestrator's side of an inference server: health, the policy it serves, in-flight weight updates, load.

All calls are async and carry the server's key. They go over aiohttp with connections kept alive, as rollouts do
(primerl.envs.http_transport), and fail with httpx's exceptions, which the callers classify: a /health probe cost the
orchestrator 1.2 ms of CPU over httpx with a new connection per call, 0.10 ms so (benchmarks/control_plane.py runs
1,024 replicas). A weight update does not drain the server:

    POST /pause?mode=keep&clear_cache=false
                            the engine stops scheduling; running and queued requests freeze where they are, KV kept
    POST /collective_rpc    primerl_load_weights(path, version, group) on every worker (reload in place; a
                            collective offer is received in `group`); each answers the fingerprint it serves
    POST /resume            frozen requests continue on the new weights; new requests are scheduled again

The server resumes only once every worker proved the load (primerl.inference.worker_extension: the fingerprint of
what it serves equals the trainer's), or, after a load refused before it touched a weight, once every worker still
answers the version it proved before. A load that fails midway, or is not proven, leaves the server paused: fail
closed, nothing is generated on weights that may be torn or foreign until a later load is proven (the watcher takes
the replica out meanwhile; its frozen requests time out as failures).

A LoRA policy (an adapter directory) is loaded between the same pause and resume by `/v1/load_lora_adapter`, in
place under the served name, and `primerl_load_weights` then records its version in the workers.

A request that was running across the update continues with KV computed by the old weights (its sample records both
versions). A request that arrives after the pause never touches KV from older weights: the server's cache-salt
middleware (primerl.inference.cache_salt) salts every request with the number of pauses so far.
"""

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from primerl.envs.http_transport import httpx_errors
from primerl.orchestrator.engine_load import EngineLoad, parse_engine_load
from primerl.transport.identity import served_by
from primerl.transport.verified import VerifiedConnector
from primerl.transport.weights import SERVED_MODEL_NAME, UNPROVEN, is_adapter, load_deadline_s
from primerl.utils.log import get_logger
from primerl.utils.wait import wait_until_async

log = get_logger(__name__)
# Idle admin connections are reused for this long: under vLLM's (uvicorn's) 5 s keep-alive, so none is reused as the
# server closes it, and over the health round (primerl.orchestrator.health: ~2 s), so a probe reuses the last one.
ADMIN_KEEPALIVE_S = 4.0


@dataclass
class Loaded:
    seconds: float  # paused, load included
    fingerprint: str  # of the weights the workers serve now, the trainer's


class NotProven(RuntimeError):
    """A load whose workers do not serve the trainer's fingerprint (or found none): the server stays paused."""


class InferenceClient:
    """`server_id`: the run's server id (primerl.transport.identity); a server answering with another is not ours."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0, server_id: str | None = None
    ):
        self.base_url, self.server_id, self.timeout_s = base_url, server_id, timeout_s
        self.api_key = api_key
        self._foreign_seen = False
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        """The session, opened on first use on the loop that uses it. Idle connections live ADMIN_KEEPALIVE_S, under
        vLLM's 5 s, so a request never goes out on a connection the server is closing; a response that closes its
        connection (vLLM's after a 500) is not reused. Every new connection proves the run's server is at its other
        end before the key goes over it (primerl.transport.verified)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            connector = VerifiedConnector(self.api_key, limit=0, keepalive_timeout=ADMIN_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
            self._session_loop = loop
        return self._session

    async def _call(
        self, method: str, path: str, timeout_s: float | None = None, **kwargs: Any
    ) -> tuple[int, bytes, Any]:
        """(status, body, headers) of one request; an httpx exception when it got no answer (a timeout is
        httpx.TimeoutException)."""
        seconds = timeout_s or self.timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
        with httpx_errors(None):
            async with self._http().request(method, self.base_url + path, timeout=timeout, **kwargs) as answer:
                return answer.status, await answer.read(), answer.headers

    async def _post_ok(self, path: str, **kwargs: Any) -> None:
        status, body, _ = await self._call("POST", path, **kwargs)
        if status != 200:
            raise RuntimeError(
                f"POST {path} failed on {self.base_url} ({status}): {body[:500].decode(errors='replace')}"
            )

    def move_to(self, base_url: str) -> None:
        """Talk to the server at `base_url` from now on (its job was requeued elsewhere). Connections are kept per
        address, so none of the old address is reused."""
        self.base_url = base_url

    async def health(self) -> bool | None:
        """True: /health answered 200. False: the server refused (no listener, an error status, a broken answer): it is
        down. None: no answer within 5 s, which a loaded server may give and a hung one gives; the caller weighs it
        (primerl.utils.liveness)."""
        try:
            status, _, headers = await self._call("GET", "/health", timeout_s=5.0)
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return False
        if status == 200 and not served_by(headers, self.server_id):
            if not self._foreign_seen:  # another run's server on our address: as good as none
                log.warning("%s answers as another run's server, not this run's: it is not used", self.base_url)
                self._foreign_seen = True
            return False
        return status == 200

    async def healthy(self) -> bool:
        return await self.health() is True

    async def wait_healthy(self, timeout_s: float, before_probe: Callable[[], None] = lambda: None) -> None:
        """Until /health answers 200, probing every second at most (`before_probe` runs before each): a probe costs
        the server one cheap request, while a back-off to 10 s made every run's first batch wait ~5 s on average
        after its server was ready."""

        async def ready() -> bool:
            before_probe()
            return await self.healthy()

        what = f"inference server {self.base_url} to be healthy (inference.startup_timeout_s)"
        await wait_until_async(ready, what, timeout_s, poll_s=0.5, max_poll_s=1.0)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float | None]:
        """The server's log-prob of each of `token_ids` given those before it (None for the first): vLLM's
        `prompt_logprobs` of a one-token completion, the model scoring a sequence it did not sample."""
        body = {"model": SERVED_MODEL_NAME, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
        status, answer, _ = await self._call("POST", "/v1/completions", json=body)
        if status != 200:
            raise RuntimeError(f"scoring failed on {self.base_url} ({status}): {answer[:300].decode(errors='replace')}")
        scored = json.loads(answer)["choices"][0]["prompt_logprobs"]
        return [None if entry is None else entry[str(token)]["logprob"] for token, entry in zip(token_ids, scored)]

    async def _rpc(self, method: str, *args: str, timeout_s: float | None = None) -> list[str]:
        body = {"method": method, "args": list(args)}
        status, answer, _ = await self._call("POST", "/collective_rpc", timeout_s=timeout_s, json=body)
        if status != 200:
            raise RuntimeError(
                f"{method} failed on {self.base_url} ({status}): {answer[:500].decode(errors='replace')}"
            )
        return [str(x) for x in json.loads(answer)["results"]]

    async def policy_version(self) -> int:
        """The version every worker serves; when they differ, the oldest of them (UNPROVEN, -1, when one is unproven):
        one server of a prefill/decode pair restarted on the start model while the other serves on, or a load cut
        halfway. The server then counts as not serving the current version, so it is loaded again, which makes its
        workers agree."""
        return min(int(v) for v in await self._rpc("primerl_get_policy_version"))

    async def collective_group(self, replica: int) -> tuple[str, int]:
        """(the name, the members) of the process group in which replica `replica` receives collective offers: its
        workers' identity (new for a new process, or after a failed transfer), trainer rank 0 included."""
        identities = await self._rpc("primerl_collective_identity")
        return f"r{replica}-{identities[0]}", len(identities) + 1

    async def load_weights(self, path: str | Path, version: int, group: str = "") -> Loaded:
        """Pause (keeping in-flight requests), load `path` as policy `version` (a collective offer: in `group`), and
        resume once every worker proved it (module docstring); NotProven, or the load's error, with the server
        left paused."""
        started = time.perf_counter()
        # clear_cache=false: vLLM's default would preempt every running request and recompute its KV after resume
        await self._post_ok("/pause", params={"mode": "keep", "clear_cache": "false"})
        try:
            if is_adapter(path):
                await self._load_adapter(path)
            deadline = load_deadline_s(path, self.timeout_s)  # a collective transfer may outlast the default
            rpc = self._rpc("primerl_load_weights", str(path), str(version), group, timeout_s=deadline)
            answers = [json.loads(a) for a in await rpc]
        except Exception:
            # a load refused before it touched a weight (a path outside the run, a bad version) leaves every worker
            # on its proven version: that one is served again; one that failed midway left them unproven: paused
            if await self._serves_a_proven_version():
                await self.resume()
            raise
        wrong = [answer for answer in answers if answer["version"] != version]
        if wrong:
            raise NotProven(
                f"{self.base_url} serves fingerprint {wrong[0]['fingerprint']} after loading v{version}, not the "
                f"trainer's {wrong[0]['expected'] or '(none written within the transfer timeout)'}: kept paused"
            )
        await self.resume()
        return Loaded(time.perf_counter() - started, answers[0]["fingerprint"])

    async def resume(self) -> None:
        """Resume a server whose workers proved the version it should serve (a no-op on one not paused)."""
        await self._post_ok("/resume")

    async def _serves_a_proven_version(self) -> bool:
        try:
            return await self.policy_version() != UNPROVEN
        except (httpx.HTTPError, RuntimeError):
            return False

    async def _load_adapter(self, path: str | Path) -> None:
        body = {"lora_name": SERVED_MODEL_NAME, "lora_path": str(path), "load_inplace": True}
        status, answer, _ = await self._call("POST", "/v1/load_lora_adapter", json=body)
        if status != 200:
            raise RuntimeError(
                f"loading the adapter {path} failed on {self.base_url} ({status}): "
                f"{answer[:500].decode(errors='replace')}"
            )

    async def running_requests(self) -> float | None:
        """vLLM's `num_requests_running` gauge (None when unreadable)."""
        load = await self.engine_load()
        return load.running if load is not None else None

    async def engine_load(self) -> EngineLoad | None:
        """Running and waiting requests, KV cache usage and preemptions from vLLM's /metrics (None when unreadable;
        a metric the server does not export reads 0)."""
        try:
            status, body, _ = await self._call("GET", "/metrics", timeout_s=5.0)
        except httpx.HTTPError:
            return None
        if status != 200:
            return None
        return parse_engine_load(body.decode(errors="replace"))
