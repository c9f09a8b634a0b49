"""ASGI middleware loaded into vLLM (`--middleware`): every generate answer says which policy version the server
served when it answered (`POLICY_VERSION_HEADER`), so a journaled turn records what sampled it
(primerl.envs.episode_journal).

The version is the one of the last `/collective_rpc primerl_load_weights(path, version, ...)` answered 200 (every
load, by file or by collective, goes through it; the orchestrator resumes a server only once its workers proved the
version), and 0 before any: a server starts on the start weights, as its workers' `primerl_policy_version` does.
The header goes out with the answer's start, which for a non-streamed generate is when its last token is sampled: a
request that spanned a load has its earlier tokens from the version before. Assumes one API-server process (vLLM's
default), since the version lives in its memory.
"""

from primerl.inference.guard import GENERATE_PATHS, RPC_PATH, headers_added, read_body, replay, rpc_call
from primerl.transport.weights import POLICY_VERSION_HEADER

LOAD_METHOD = "primerl_load_weights"  # primerl.inference.worker_extension


def loaded_version(body: bytes) -> int | None:
    """The version a `/collective_rpc` body loads, or None when it is no load."""
    method, args = rpc_call(body)
    try:
        return int(args[1]) if method == LOAD_METHOD else None
    except (ValueError, IndexError, TypeError):
        return None


class ServedPolicyVersion:
    def __init__(self, app):
        self.app = app
        self.version = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in GENERATE_PATHS:
            return await self.app(scope, receive, headers_added(send, self._stamp))
        if path == RPC_PATH:
            body = await read_body(receive)
            version = loaded_version(body)
            if version is not None:
                return await self.app(scope, replay(body, receive), self._on_success(send, version))
            receive = replay(body, receive)
        return await self.app(scope, receive, send)

    def _stamp(self) -> list[tuple[bytes, bytes]]:
        return [(POLICY_VERSION_HEADER.encode(), str(self.version).encode())]

    def _on_success(self, send, version: int):
        async def noted(message):
            if message["type"] == "http.response.start" and message["status"] == 200:
                self.version = version
            await send(message)

        return noted
