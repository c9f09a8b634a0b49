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
