"""Reading verifiers traces."""

import verifiers.v1 as vf


def final_reply(trace: vf.Trace) -> str:
    """The text of the last assistant message of the trace's last branch ("" if the model never answered)."""
    if not trace.branches:
        return ""
    for message in reversed(trace.branches[-1].messages):
        if message.role == "assistant":
            return message.content if isinstance(message.content, str) else str(message.content or "")
    return ""


def prompt_text(trace: vf.Trace) -> str:
    """The messages before the first assistant message of the trace's first branch, one `role: text` line each."""
    if not trace.branches:
        return ""
    lines = []
    for message in trace.branches[0].messages:
        if message.role == "assistant":
            break
        content = message.content if isinstance(message.content, str) else str(message.content or "")
        lines.append(f"{message.role}: {content}")
    return "\n".join(lines)
