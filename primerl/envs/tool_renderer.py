"""How rollouts of a model that `renderers` does not know (the tiny model, a fine-tune, a local path) are rendered and
parsed: its own chat template, with Hermes `<tool_call>` parsing so tool-using environments work.

renderers' default renderer refuses tools unless a tool parser is set, and its Qwen3 (Hermes) parser reports a
malformed `<tool_call>` block (bad JSON, no name, never closed) as a nameless attempt, which verifiers then drops:
the harness would take a broken call for a final answer. `HermesRenderer` keeps such an attempt as a call named
`MALFORMED_TOOL_CALL` carrying the parser's status and the raw text, so the harness can end the rollout and count
why. Well-formed calls and plain replies parse exactly as renderers' own default renderer with `tool_parser="qwen3"`.
"""

from pathlib import Path

from renderers import CustomRendererConfig
from renderers.base import MODEL_RENDERER_MAP, ParsedResponse, ToolCallParseStatus
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

MALFORMED_TOOL_CALL = "<malformed tool call>"  # not a valid tool name in any schema, so never a real tool's


class HermesRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def parse_response(self, token_ids, *, tools=None, prompt_ids=None) -> ParsedResponse:
        parsed = super().parse_response(token_ids, tools=tools, prompt_ids=prompt_ids)
        for call in parsed.tool_calls:
            if call.status is not ToolCallParseStatus.OK:
                call.arguments = {"status": str(call.status), "text": call.raw}
                call.name = MALFORMED_TOOL_CALL
        return parsed


def renderer_name(model_path: str) -> str:
    """The name to render `model_path` by: a hub model's id (also when given as its snapshot in the Hugging Face
    cache, `.../models--Qwen--Qwen3-0.6B/snapshots/<rev>`, which is how every process gets a hub model), else the
    path itself."""
    for part in Path(model_path).parts:
        if part.startswith("models--") and (name := part.removeprefix("models--").replace("--", "/", 1)):
            if name in MODEL_RENDERER_MAP:
                return name
    return model_path


def renderer_config(model_path: str) -> CustomRendererConfig | None:
    """The renderer for `model_path`: renderers' own for a model it knows by name (e.g. `Qwen/Qwen3-0.6B`), else
    `HermesRenderer` over the model's chat template."""
    if renderer_name(model_path) in MODEL_RENDERER_MAP:
        return None
    return CustomRendererConfig(import_path=f"{__name__}.HermesRenderer", tool_parser="qwen3")
