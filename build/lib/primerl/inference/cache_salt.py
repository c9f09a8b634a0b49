"""ASGI middleware loaded into vLLM (`--middleware`): no request after a weight update reuses KV computed with older
weights.

vLLM reuses cached KV blocks of an identical token prefix (prefix caching) across requests. After an in-place weight
load those blocks hold keys and values of the *old* weights, and a new request with the same system prompt would
silently attend to them. vLLM keys its block hashes by the request's `cache_salt` too, so this middleware salts every
generate request with the weight epoch: the number of `/pause` calls that have completed, the first step of every
update (primerl.orchestrator.inference_client: pause -> load -> resume).

Why that is enough: the engine schedules nothing between the end of `/pause` and `/resume`, so every block salted with
epoch e was computed after pause e had taken effect, that is after update e had loaded (or, for e = 0, with the start
weights), until pause e + 1. A request that arrives while a pause is in progress waits for it, then takes the new
epoch. Requests admitted before a pause keep their old salt and may finish on the new weights (a rollout may span
versions, and records both); no later request can share their blocks. A client's own salt is kept, prefixed.
Assumes one API-server process (vLLM's default), since the epoch lives in its memory.
"""

import asyncio
import json

from primerl.inference.guard import read_body, replay

SALTED_PATHS = frozenset({"/inference/v1/generate", "/v1/chat/completions", "/v1/completions"})
PAUSE_PATH = "/pause"


class WeightEpochCacheSalt:
    def __init__(self, app):
        self.app = app
        self.epoch = 0
        self.pausing: asyncio.Event | None = None  # set while a /pause is in progress; requests wait on it

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path == PAUSE_PATH:
            return await self._pause(scope, receive, send)
        if path not in SALTED_PATHS:
            return await self.app(scope, receive, send)
        while self.pausing is not None:
            await self.pausing.wait()
        body = await read_body(receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if isinstance(request, dict):
            own = request.get("cache_salt")
            request["cache_salt"] = f"w{self.epoch}" + (f"-{own}" if isinstance(own, str) and own else "")
            body = json.dumps(request).encode()
            scope = {
                **scope,
                "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                + [(b"content-length", str(len(body)).encode())],
            }
        return await self.app(scope, replay(body, receive), send)

    async def _pause(self, scope, receive, send):
        if self.pausing is not None:  # a second pause while one is in progress: the same update
            return await self.app(scope, receive, send)
        self.pausing = asyncio.Event()
        status = {}

        async def capture(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            if status.get("code") == 200:
                self.epoch += 1
            pausing, self.pausing = self.pausing, None
            pausing.set()
