"""ASGI middleware loaded into vLLM (`--middleware`) to bridge a wire-format gap.

vLLM 0.32's `/inference/v1/generate` returns each logprob as `{"token_id": N, ...}`; the verifiers train client
(through `renderers` 0.1.12) requires `{"token": "token_id:N", ...}` and rejects the response otherwise. This adds
the `token` field to non-streaming generate responses and leaves every other route untouched.
"""

import json

GENERATE_PATH = "/inference/v1/generate"


def add_token_strings(payload):
    if not isinstance(payload, dict):  # e.g. `null` for a request whose client went away
        return payload
    for choice in payload.get("choices") or []:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            if "token_id" in entry and "token" not in entry:
                entry["token"] = f"token_id:{entry['token_id']}"
            for candidate in entry.get("top_logprobs") or []:
                if "token_id" in candidate and "token" not in candidate:
                    candidate["token"] = f"token_id:{candidate['token_id']}"
    return payload


class GenerateLogprobTokens:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != GENERATE_PATH:
            return await self.app(scope, receive, send)
        start: dict = {}
        chunks: list[bytes] = []

        async def capture(message):
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            content_type = dict(start.get("headers", [])).get(b"content-type", b"")
            if content_type.startswith(b"application/json"):
                try:
                    body = json.dumps(add_token_strings(json.loads(body))).encode()
                except ValueError:
                    pass  # not JSON after all: pass through unchanged
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return await self.app(scope, receive, capture)
