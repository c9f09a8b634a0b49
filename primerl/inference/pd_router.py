"""Prefill/decode disaggregation: one address in front of a prefill and a decode vLLM server.

The orchestrator, the evaluator and the watcher talk to the router as to any server (`inference.port`); it
answers with the guard's rules (primerl.inference.guard: routes, key, server id). Per generate request
(`/inference/v1/generate`, `/v1/chat/completions`, `/v1/completions`): the request with a one-token budget, not
streamed, goes to the prefill server, whose KV connector stores the prompt's KV; then the request as it came goes to
the decode server, whose connector loads that KV and decodes. The decode server's answer (token ids, logprobs; a
stream passed through as it comes) is the router's. With `inference.replicas` > 1 each pair has its own router
(`start_routers`). Admin calls (`/pause`, `/resume`, `/collective_rpc`, `/is_paused`) go to both servers, so a weight
update reaches both before the version moves; `/collective_rpc` answers with both servers' results, so a version
read is the same on every worker of both or an error.

Invariant: no KV of older weights is ever decoded from. The connector keys stored KV by the prompt's token ids
alone (not the cache salt), so the router empties the store while both servers are paused; no prefill runs across
an update (a pause waits for the prefills in flight, and prefills that arrive during an update wait for the
resume), so nothing computed before the update lands in the store after it. A request whose prefill finished before
the update and whose decode comes after finds nothing stored and is prefilled by the decode server itself, on the
new weights.
"""

import asyncio
import os
import shutil
import threading
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from primerl.config.inference import InferenceConfig, pd_pairs
from primerl.inference.guard import API_KEY_ENV, InferenceGuard
from primerl.transport.address import read_address
from primerl.transport.identity import SERVER_ID_ENV
from primerl.transport.run_dir import pd_kv_store
from primerl.transport.verified import verified_transport
from primerl.transport.weights import POLICY_VERSION_HEADER
from primerl.utils.wait import wait_until

GENERATE_PATHS = ("/inference/v1/generate", "/v1/chat/completions", "/v1/completions")
# the store holds every prompt's KV until the next weight update: past this many prompts (an eval's, which has no
# update) it is emptied between prefills, so it stays bounded (a prompt found missing is prefilled by the decode
# server itself); and it is emptied when the router stops, so nothing of it outlives the serving
MAX_STORED_PROMPTS = 4096
BOTH_PATHS = ("/pause", "/resume", "/collective_rpc", "/is_paused")


def one_token(path: str, body: dict) -> dict:
    """`body` with a budget of one new token, answered whole: what the prefill server is asked for."""
    body = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    if path == "/inference/v1/generate":
        return {**body, "sampling_params": {**body.get("sampling_params", {}), "max_tokens": 1}}
    return {**body, "max_tokens": 1, "max_completion_tokens": 1}


def answer(response: httpx.Response) -> Response:
    """The server's answer as the router's, with the policy version it served (the decode server's, which sampled)."""
    kind = response.headers.get("content-type", "application/json")
    version = response.headers.get(POLICY_VERSION_HEADER)
    headers = {POLICY_VERSION_HEADER: version} if version is not None else None
    return Response(response.content, response.status_code, headers=headers, media_type=kind)


class PdRouter:
    def __init__(self, prefill_url: str, decode_url: str, kv_store: str | Path, api_key: str | None = None):
        self.prefill_url, self.decode_url, self.kv_store = prefill_url, decode_url, Path(kv_store)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # every connection to a backend proves it is the run's server before the key goes over it: a backend's port
        # is free while its server restarts, and another user may bind it
        transport = verified_transport(api_key, limits=httpx.Limits(max_connections=None))
        self.http = httpx.AsyncClient(headers=headers, timeout=None, transport=transport)
        self.prefilling = 0
        self.prefills_done = asyncio.Event()
        self.prefills_done.set()
        self.update_over: asyncio.Event | None = None  # set while a weight update is in progress
        self.generated = 0
        self.server: uvicorn.Server | None = None  # serving it (start_router)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.empty_store()

    def app(self) -> Starlette:
        routes = [Route(path, self.generate, methods=["POST"]) for path in GENERATE_PATHS]
        routes += [Route(path, self.both, methods=["GET", "POST"]) for path in BOTH_PATHS]
        routes += [Route("/health", self.health, methods=["GET"]), Route("/metrics", self.metrics, methods=["GET"])]
        routes += [Route("/v1/models", self.models, methods=["GET"])]
        return Starlette(routes=routes)

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        path = request.url.path
        while self.update_over is not None:
            await self.update_over.wait()
        self.generated += 1
        if self.generated % 64 == 0 and self.prefilling == 0 and self.stored_prompts() > MAX_STORED_PROMPTS:
            self.empty_store()
        self.prefilling += 1
        self.prefills_done.clear()
        try:
            prefill = await self.http.post(self.prefill_url + path, json=one_token(path, body))
        finally:
            self.prefilling -= 1
            if self.prefilling == 0:
                self.prefills_done.set()
        if prefill.status_code != 200:
            return answer(prefill)
        if not body.get("stream"):
            return answer(await self.http.post(self.decode_url + path, json=body))
        decode = await self.http.send(self.http.build_request("POST", self.decode_url + path, json=body), stream=True)
        kind = decode.headers.get("content-type", "text/event-stream")
        return StreamingResponse(
            decode.aiter_raw(), decode.status_code, media_type=kind, background=BackgroundTask(decode.aclose)
        )

    async def both(self, request: Request) -> Response:
        path, body = request.url.path, await request.body()
        if path == "/pause":
            self.update_over = self.update_over or asyncio.Event()
            await self.prefills_done.wait()
        calls = [
            self.http.request(request.method, url + path, content=body, params=request.query_params)
            for url in (self.prefill_url, self.decode_url)
        ]
        prefill, decode = await asyncio.gather(*calls)
        if path == "/pause" and prefill.status_code == decode.status_code == 200:
            self.empty_store()
        if path == "/resume" and self.update_over is not None:
            self.update_over.set()
            self.update_over = None
        for response in (prefill, decode):
            if response.status_code != 200:
                return answer(response)
        if path == "/collective_rpc":
            return JSONResponse({"results": prefill.json()["results"] + decode.json()["results"]})
        return answer(decode)

    def stored_prompts(self) -> int:
        return sum(1 for _ in self.kv_store.iterdir()) if self.kv_store.is_dir() else 0

    def empty_store(self) -> None:
        if self.kv_store.is_dir():
            for entry in self.kv_store.iterdir():
                shutil.rmtree(entry, ignore_errors=True)

    async def health(self, request: Request) -> Response:
        answers = await asyncio.gather(
            *(self.http.get(url + "/health", timeout=5.0) for url in (self.prefill_url, self.decode_url)),
            return_exceptions=True,
        )
        up = all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers)
        return Response(status_code=200 if up else 503)

    async def metrics(self, request: Request) -> Response:
        return answer(await self.http.get(self.decode_url + "/metrics"))

    async def models(self, request: Request) -> Response:
        return answer(await self.http.get(self.decode_url + "/v1/models"))


def start_router(
    host: str, port: int, prefill_url: str, decode_url: str, kv_store: Path, server_env: dict[str, str]
) -> PdRouter:
    """Serve a `PdRouter` at host:port from a thread of this process, behind the guard with the servers' key and
    run id (`server_env`: a server spec's environment); returns once it listens."""
    os.environ.update({k: v for k, v in server_env.items() if k in (API_KEY_ENV, SERVER_ID_ENV)})
    router = PdRouter(prefill_url, decode_url, kv_store, server_env.get(API_KEY_ENV))
    server = uvicorn.Server(uvicorn.Config(InferenceGuard(router.app()), host=host, port=port, log_level="warning"))
    router.server = server
    threading.Thread(target=server.run, name="pd-router", daemon=True).start()
    wait_until(lambda: server.started, f"the prefill/decode router at {host}:{port}", timeout_s=30, poll_s=0.1)
    return router


def start_routers(inf: InferenceConfig, run_dir: str | Path, server_env: dict[str, str]) -> list[PdRouter]:
    """A router per pair of `inference.replicas` (`inference.port` + i), in front of this process's decode server and
    its prefill server (at `inference.pd.prefill_host` when set: another job's). Router ports must be chosen (not 0)."""
    prefill_host = inf.pd.prefill_host or inf.host
    return [
        start_router(
            inf.host,
            pair.router_port,
            f"http://{prefill_host}:{pair.prefill_port}",
            f"http://{inf.host}:{pair.decode_port}",
            pd_kv_store(run_dir, pair.index),
            server_env,
        )
        for pair in pd_pairs(inf)
    ]


def follow_prefill(routers: list[PdRouter], run_dir: str | Path, inf: InferenceConfig) -> list[str]:
    """SLURM decode job: point its routers at the prefill servers where the prefill job advertises them now (a
    requeued prefill job serves from another node and port). Job j's pairs start at j x replicas (primerl.launch.slurm),
    which names its prefill job's address. Returns the routers' prefill URLs that changed."""
    found = read_address(run_dir, inf.pd.first_pair // inf.replicas, "prefill")
    if found is None:
        return []
    moved = []
    for router, offset in zip(routers, range(inf.replicas), strict=True):
        url = f"http://{found['host']}:{found['port'] + offset}"
        if router.prefill_url != url:  # read by the router's thread per request: one assignment
            router.prefill_url = url
            moved.append(url)
    return moved
