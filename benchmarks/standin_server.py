"""A stand-in for a vLLM inference server, for load tests of the orchestrator: it speaks the routes primerl's
processes call, with a latency model instead of a model, so the orchestrator, env workers and batch writer run
unchanged against it and only the orchestrator's own cost is left to measure.

    python -m benchmarks.standin_server --port 8000 --replicas 4 [--ttft-s 0.0] [--token-s 0.0] [--concurrency 0]

Routes (what primerl uses of vLLM, see primerl.orchestrator.inference_client and renderers' generate client):
- `POST /inference/v1/generate`: after `ttft_s + tokens * token_s` (at most `concurrency` requests at once, 0: no
  limit) returns `min(max_tokens, --tokens)` completion tokens (the prompt's last tokens, reversed, then the first
  stop token) with logprobs in the wire format primerl's vLLM middleware produces; a request admitted during a
  pause waits for the resume, as vLLM's `/pause?mode=keep` freezes it;
- `POST /pause`, `POST /resume`, `GET /is_paused`;
- `POST /collective_rpc`: `primerl_get_policy_version` and `primerl_load_weights(path, version)` (which sleeps
  `--load-s` and serves `version` from then on);
- `GET /health` (with the run's `x-primerl-server` id), `GET /v1/models` (max_model_len), `GET /metrics`
  (`vllm:num_requests_running`).
With `--last-fails-after-loads N`, the last replica fails 1 s after its N-th weight load: every route answers 503 from
then on, as a server whose engine died behind its port; `--stats` records when, and when the last generation request
reached it afterwards (how long the orchestrator kept routing rollouts to it).
One process serves every replica (one aiohttp site per port). Not a product feature: it lives in benchmarks/.
"""

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

from aiohttp import web

from primerl.transport.atomic import write_json
from primerl.transport.identity import SERVER_ID_HEADER
from primerl.transport.weights import published_fingerprint


@dataclass
class Latency:
    ttft_s: float = 0.0  # time to first token
    token_s: float = 0.0  # per completion token
    tokens: int = 8  # completion length (at most the request's max_tokens)
    concurrency: int = 0  # requests generating at once; 0: no limit
    load_s: float = 0.0  # a weight load


@dataclass
class Replica:
    """One stand-in server's state."""

    latency: Latency
    server_id: str | None = None
    max_model_len: int = 4096
    version: int = 0
    running: int = 0
    served: int = 0
    loads: int = 0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    slots: asyncio.Semaphore | None = None
    requests: dict[str, int] = field(default_factory=dict)  # per route, every request this replica received
    fails_after_loads: int = 0  # 0: never fails
    failed_at: float | None = None  # wall time it started failing
    generate_after_failure: float | None = None  # wall time of the last generation request it got since

    def __post_init__(self) -> None:
        self.resumed.set()
        if self.latency.concurrency:
            self.slots = asyncio.Semaphore(self.latency.concurrency)

    def headers(self) -> dict[str, str]:
        return {SERVER_ID_HEADER: self.server_id} if self.server_id else {}

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self.resumed.wait()
        params = body.get("sampling_params") or {}
        prompt = list(body.get("token_ids") or [])
        stops = list(params.get("stop_token_ids") or [])
        n = max(1, min(int(params.get("max_tokens") or self.latency.tokens), self.latency.tokens))
        tokens = (prompt[::-1] * n)[: n - 1 if stops else n] + stops[:1]
        self.running += 1
        try:
            if self.slots is not None:
                async with self.slots:
                    await asyncio.sleep(self.latency.ttft_s + len(tokens) * self.latency.token_s)
            else:
                await asyncio.sleep(self.latency.ttft_s + len(tokens) * self.latency.token_s)
            await self.resumed.wait()  # frozen by a pause that came meanwhile
        finally:
            self.running -= 1
        self.served += 1
        content = [{"token_id": t, "token": f"token_id:{t}", "logprob": -0.5} for t in tokens]
        choice = {
            "index": 0,
            "token_ids": tokens,
            "logprobs": {"content": content},
            "finish_reason": "stop" if stops else "length",
        }
        answer = {"request_id": f"standin-{self.served}", "choices": [choice], "prompt_token_ids": prompt}
        return web.json_response(answer, headers=self.headers())

    async def rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method, args = body.get("method"), body.get("args") or []
        if method == "primerl_get_policy_version":
            return web.json_response({"results": [self.version]}, headers=self.headers())
        if method == "primerl_load_weights":
            await asyncio.sleep(self.latency.load_s)
            self.version, self.loads = int(args[1]), self.loads + 1
            if self.loads == self.fails_after_loads:
                asyncio.get_running_loop().call_later(1.0, lambda: setattr(self, "failed_at", time.time()))
            # it holds no weights: it answers with the trainer's fingerprint, as a server that loaded them would
            fingerprint = published_fingerprint(args[0])
            answer = json.dumps({"version": self.version, "fingerprint": fingerprint, "expected": fingerprint})
            return web.json_response({"results": [answer]}, headers=self.headers())
        return web.json_response({"error": f"unknown method {method}"}, status=403, headers=self.headers())

    async def pause(self, request: web.Request) -> web.Response:
        self.resumed.clear()
        return web.json_response({}, headers=self.headers())

    async def resume(self, request: web.Request) -> web.Response:
        self.resumed.set()
        return web.json_response({}, headers=self.headers())

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": not self.resumed.is_set()}, headers=self.headers())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="", headers=self.headers())

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": "policy", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]}, headers=self.headers())

    async def metrics(self, request: web.Request) -> web.Response:
        text = f'vllm:num_requests_running{{model_name="policy"}} {self.running}\n'
        return web.Response(text=text, headers=self.headers())

    @web.middleware
    async def count(self, request: web.Request, handler):
        self.requests[request.path] = self.requests.get(request.path, 0) + 1
        if self.failed_at is not None:
            if request.path == "/inference/v1/generate":
                self.generate_after_failure = time.time()
            return web.Response(status=503, text="the engine died")
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self.count])
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/collective_rpc", self.rpc)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_get("/is_paused", self.is_paused)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        return app


async def serve(
    host: str, ports: list[int], latency: Latency, server_id: str | None, last_fails_after_loads: int = 0
) -> list[Replica]:
    """Start one stand-in per port in this event loop; returns their states (they serve until the loop ends)."""
    replicas = []
    for port in ports:
        fails = last_fails_after_loads if port == ports[-1] else 0
        replica = Replica(latency, server_id, fails_after_loads=fails)
        runner = web.AppRunner(replica.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        replicas.append(replica)
    return replicas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the first replica's port; the others follow")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--server-id", help="the run's server id (primerl.transport.identity.server_identity)")
    parser.add_argument("--ttft-s", type=float, default=0.0)
    parser.add_argument("--token-s", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=0)
    parser.add_argument("--load-s", type=float, default=0.0)
    parser.add_argument("--last-fails-after-loads", type=int, default=0, help="0: no replica fails")
    parser.add_argument(
        "--stats", help="write each replica's counts, and all requests per route, here (JSON) each second"
    )
    args = parser.parse_args()
    latency = Latency(args.ttft_s, args.token_s, args.tokens, args.concurrency, args.load_s)

    async def run() -> None:
        ports = [args.port + i for i in range(args.replicas)]
        replicas = await serve(args.host, ports, latency, args.server_id, args.last_fails_after_loads)
        print(f"stand-in serving on {args.host}:{ports[0]}..{ports[-1]}", flush=True)
        while True:
            await asyncio.sleep(1.0)
            if args.stats:
                counts = [
                    {"served": r.served, "running": r.running, "loads": r.loads, "failed_at": r.failed_at}
                    | {"generate_after_failure": r.generate_after_failure}
                    for r in replicas
                ]
                requests: dict[str, int] = {}
                for replica in replicas:
                    for route, n in replica.requests.items():
                        requests[route] = requests.get(route, 0) + n
                write_json(args.stats, {"time": time.time(), "replicas": counts, "requests": requests})

    asyncio.run(run())


if __name__ == "__main__":
    main()
