"""`primerl-chat`: an in-process chat harness for verifiers v1, with tool calling.

Every model call goes through the rollout's interception endpoint (so the train client records token ids,
sampled mask and logprobs), but no program is launched: no `uv`, no sandbox, no network. It supports multi-turn
exchanges: the default `resume()` relaunches it on the accreted conversation.

Tools: when the task has tool servers (verifiers `toolsets`, MCP), their tools are offered to the model in every
request; the renderer (primerl.envs.tool_renderer for models renderers does not know) puts their schemas in the chat
template and parses `<tool_call>` blocks. The loop runs each call on its server and answers with a tool message
until the model answers without a call, `max_turns` model turns, `token_budget` sampled tokens, or a prompt that no
longer fits the server's context (`context_length`: the tool results filled it; the reply so far is scored). A call to an
unknown tool, with arguments that are not an object, that fails or that times out is answered to the model as a
tool error; a malformed call ends the rollout (its reply is scored as it stands). Each outcome is counted in the
trace's metrics (`tool_*`). Tool results are prompt tokens of the next turn, so they are never trained on.

The call is one POST over aiohttp, not the OpenAI SDK over httpx: httpcore's connection pool rescans every connection
for every queued request, which at a batch of rollouts in flight cost more orchestrator CPU than the rest of a
rollout (benchmarks/inference.py). A session per call costs ~0.02 ms; pooling across calls measured no better.
"""

import asyncio
import json
from collections import Counter
from contextlib import AsyncExitStack

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import connect_mcp, mcp_content_to_chat_content
from verifiers.v1.runtimes import ProgramResult

from primerl.envs.tool_renderer import MALFORMED_TOOL_CALL

# No total limit: the orchestrator's rollout_timeout_s bounds a rollout.
CHAT_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30)
# trace.info key, read by `tool_use`: {"tool", "outcome"} per call (a malformed one also has "detail"), then
# {"stop", "turns"} per launch
TOOL_LOG = "primerl_tool_calls"
TOOL_ERRORS = ("unknown_tool", "bad_arguments", "failed", "timeout", "malformed")
STOPS = ("answer", "max_turns", "token_budget", "malformed", "context_length")


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = "primerl-chat"
    max_turns: int = 8  # model turns per launch when tools are offered (each answered call costs one)
    token_budget: int = 1024  # sampled tokens per launch, over all turns
    tool_timeout_s: float = 10.0  # one tool call, reconnects included


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with aiohttp.ClientSession(timeout=CHAT_TIMEOUT) as http:
            chat = _Chat(http, endpoint, secret, ctx.model)
            if not mcp_urls:
                reply = await chat(messages)
                return ProgramResult(exit_code=0, stdout=reply.get("content") or "", stderr="")
            async with AsyncExitStack() as stack:
                servers = {name: {"url": url, "timeout": self.config.tool_timeout_s} for name, url in mcp_urls.items()}
                tools, dispatch, connections = await connect_mcp({"mcpServers": servers}, stack)
                log = trace.info.setdefault(TOOL_LOG, [])
                answer = await self._tool_loop(chat, messages, tools, dispatch, connections, log)
        return ProgramResult(exit_code=0, stdout=answer, stderr="")

    async def _tool_loop(self, chat, messages, tools, dispatch, connections, log: list) -> str:
        sampled, turns, reply, stop = 0, 0, {}, "max_turns"
        for _ in range(self.config.max_turns):
            if sampled >= self.config.token_budget:
                stop = "token_budget"
                break
            try:
                reply = await chat(messages, tools)
            except ContextFull:
                if not turns:
                    raise  # the task's own prompt does not fit: nothing to score
                stop = "context_length"
                break
            turns += 1
            sampled += chat.last_completion_tokens
            calls = reply.get("tool_calls") or []
            if not calls:
                stop = "answer"
                break
            malformed = [c["function"] for c in calls if c["function"]["name"] == MALFORMED_TOOL_CALL]
            if malformed:
                log.append({"tool": None, "outcome": "malformed", "detail": malformed[0].get("arguments", "")[:300]})
                stop = "malformed"
                break
            messages.append({"role": "assistant", "content": reply.get("content") or "", "tool_calls": calls})
            for call in calls:
                outcome, result = await self._run(call["function"], dispatch, connections)
                log.append({"tool": call["function"]["name"], "outcome": outcome})
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        log.append({"stop": stop, "turns": turns})
        return reply.get("content") or ""

    async def _run(self, function: dict, dispatch, connections) -> tuple[str, str]:
        """(outcome, what the model is told) for one well-formed call."""
        name = function["name"]
        if name not in dispatch:
            return "unknown_tool", f"error: unknown tool {name!r}; the tools are {', '.join(sorted(dispatch))}"
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return "bad_arguments", "error: the arguments must be a JSON object"
        server, tool = dispatch[name]
        try:
            result = await asyncio.wait_for(
                connections[server].run(lambda client: client.call_tool(tool, arguments)), self.config.tool_timeout_s
            )
        except TimeoutError:
            return "timeout", f"error: {name} did not answer within {self.config.tool_timeout_s:g} s"
        except Exception as err:  # noqa: BLE001 - a broken tool server is the model's tool error, not a crash
            why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            return "failed", f"error: {name} failed: {why}"
        content = mcp_content_to_chat_content(result.content)
        text = content if isinstance(content, str) else json.dumps(content)
        if result.is_error:
            return "failed", f"error: {text[:300]}"
        return "ok", text

    @vf.metric
    async def tool_use(self, trace: vf.Trace) -> dict[str, float]:
        """Per rollout that was offered tools: calls made, valid-call rate, model turns, each error and stop reason."""
        log = trace.info.get(TOOL_LOG)
        if log is None:
            return {}
        outcomes = Counter(entry["outcome"] for entry in log if "outcome" in entry)
        stops = Counter(entry["stop"] for entry in log if "stop" in entry)
        calls = sum(outcomes.values())
        metrics = {
            "tool_calls": float(calls),
            "tool_turns": float(sum(entry["turns"] for entry in log if "stop" in entry)),
            **{f"tool_error_{reason}": float(outcomes[reason]) for reason in TOOL_ERRORS},
            **{f"tool_stop_{stop}": float(stops[stop]) for stop in STOPS},
        }
        if calls:
            metrics["tool_valid_call_rate"] = outcomes["ok"] / calls
        return metrics


class ContextFull(RuntimeError):
    """The prompt is longer than the server's context (vLLM's, or the renderer's pre-flight check of it)."""


class _Chat:
    """POSTs chat completions to the rollout's interception endpoint; returns the assistant message."""

    def __init__(self, http: aiohttp.ClientSession, endpoint: str, secret: str, model: str):
        self.http, self.url, self.model = http, f"{endpoint.rstrip('/')}/chat/completions", model
        self.headers = {"Authorization": f"Bearer {secret}"}
        self.last_completion_tokens = 0

    async def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        body = {"model": self.model, "messages": messages, **({"tools": tools} if tools else {})}
        # The interception server fills in the sampling settings and records the turn; it answers errors with a
        # non-2xx status and keeps the real cause on the rollout.
        async with self.http.post(self.url, json=body, headers=self.headers) as response:
            if response.status == 400 and "maximum context length" in (text := await response.text()).lower():
                raise ContextFull(f"chat completion refused: {text[:300]}")
            if response.status >= 400:
                raise RuntimeError(f"chat completion failed: HTTP {response.status}: {(await response.text())[:300]}")
            reply = await response.json()
        self.last_completion_tokens = int((reply.get("usage") or {}).get("completion_tokens") or 0)
        return reply["choices"][0]["message"]


__all__ = ["ChatHarness", "ChatHarnessConfig"]
