"""Reading verifiers traces."""

import verifiers.v1 as vf


def _text(content: object) -> str:
    return content if isinstance(content, str) else str(content or "")


def final_reply(trace: vf.Trace) -> str:
    """The text of the last assistant message of the trace's last branch ("" if the model never answered)."""
    if not trace.branches:
        return ""
    for message in reversed(trace.branches[-1].messages):
        if message.role == "assistant":
            return _text(message.content)
    return ""


def prompt_text(trace: vf.Trace) -> str:
    """The messages before the first assistant message of the trace's first branch, one `role: text` line each."""
    if not trace.branches:
        return ""
    lines = []
    for message in trace.branches[0].messages:
        if message.role == "assistant":
            break
        lines.append(f"{message.role}: {_text(message.content)}")
    return "\n".join(lines)


def transcript(trace: vf.Trace, max_chars: int = 500) -> list[dict]:
    """The last branch's conversation for people (samples.jsonl, the ledger's MLflow traces): per message its role,
    text (first `max_chars`), tool calls, and when, in unix seconds: a model reply from its request to its response
    (`start`, `end`, with its token `usage` when the server reported it), any other message when it was recorded
    (`end`)."""
    if not trace.branches:
        return []
    branch = trace.branches[-1]
    calls = iter([c for c in branch.calls if c.node is not None])
    out = []
    for node in branch.nodes:
        message = node.message
        entry: dict = {"role": message.role, "content": _text(message.content)[:max_chars], "end": node.timestamp}
        if message.role == "assistant" and node.sampled and (call := next(calls, None)) is not None:
            entry |= {"start": call.time.start, "end": call.time.end, "finish_reason": call.finish_reason}
            if call.usage is not None:  # the server's own count: prompt tokens (cache reads included), sampled tokens
                prompt = call.usage.prompt_tokens + (call.usage.cached_input_tokens or 0)
                entry["usage"] = {"input_tokens": prompt, "output_tokens": call.usage.completion_tokens}
        if tool_calls := getattr(message, "tool_calls", None):
            entry["tool_calls"] = [{"name": c.name, "arguments": c.arguments[:max_chars]} for c in tool_calls]
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out
