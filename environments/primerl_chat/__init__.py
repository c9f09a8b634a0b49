"""`primerl-chat`: an in-process chat harness for verifiers v1.

Every model call goes through the rollout's interception endpoint (so the train client records token ids,
sampled mask and logprobs), but no program is launched: no `uv`, no sandbox, no network. It supports multi-turn
exchanges: the default `resume()` relaunches it on the accreted conversation.

The call is one POST over aiohttp, not the OpenAI SDK over httpx: httpcore's connection pool rescans every connection
for every queued request, which at a batch of rollouts in flight cost more orchestrator CPU than the rest of a
rollout (benchmarks/inference.py). A session per call costs ~0.02 ms; pooling across calls measured no better.
"""

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult

# No total limit: the orchestrator's rollout_timeout_s bounds a rollout.
CHAT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = "primerl-chat"


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        # The interception server fills in the sampling settings and records the turn; it answers errors with a
        # non-2xx status and keeps the real cause on the rollout.
        async with (
            aiohttp.ClientSession(timeout=CHAT_TIMEOUT) as http,
            http.post(
                f"{endpoint.rstrip('/')}/chat/completions",
                json={"model": ctx.model, "messages": messages},
                headers={"Authorization": f"Bearer {secret}"},
            ) as response,
        ):
            if response.status >= 400:
                raise RuntimeError(f"chat completion failed: HTTP {response.status}: {(await response.text())[:300]}")
            reply = await response.json()
        return ProgramResult(exit_code=0, stdout=reply["choices"][0]["message"].get("content") or "", stderr="")


__all__ = ["ChatHarness", "ChatHarnessConfig"]
