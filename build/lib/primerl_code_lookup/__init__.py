"""`primerl-code-lookup`: a tool-use task. Each word has a 3-digit code that only the `lookup` tool knows (a keyed hash), so
the model must call the tool with the word and answer with the code it returns. Reward: 1 when the final answer is
the code, else 0. The tool-use metrics (calls, valid-call rate, turns, errors by reason) come from the
`primerl-chat` harness. `stream=eval` draws held-out words, disjoint from the training stream of the same seed.
"""

import asyncio
import json
import random
from typing import Literal

import verifiers.v1 as vf
from primerl_chat import ChatHarness

from primerl.envs.trace_text import final_reply
from primerl_code_lookup.codebook import CodeBook, CodeBookConfig, code_of

SYSTEM_PROMPT = "Answer with the code only."
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# The SFT teacher is imperfect: for TEACHER_SKIPS of the words it answers TEACHER_GUESS without calling the tool, for
# TEACHER_TYPOS it looks up the word without its last letter; the rest are right. Its mistakes are systematic, not
# random letters or digits: random ones add noise only, and the tiny model did not learn to copy under them
# (experiments/code_lookup).
TEACHER_SKIPS, TEACHER_TYPOS, TEACHER_GUESS = 0.3, 0.2, "000"
# Each demonstration asks this many words in turn: three calls per ~200-token tools block instead of one, so more of
# each SFT step's tokens are copies (experiments/code_lookup).
DEMO_QUESTIONS = 3
DEMONSTRATIONS_VERSION = (
    2  # part of the SFT cache key (primerl.envs.demonstrations): bump when `demonstrations` changes
)


class CodeLookupData(vf.TaskData):
    word: str = ""
    code: str = ""


class CodeLookupTask(vf.Task[CodeLookupData]):
    @vf.reward
    async def correct(self, task: CodeLookupData, trace: vf.Trace) -> float:
        return float(final_reply(trace).strip() == task.code)


class CodeLookupConfig(vf.TasksetConfig):
    seed: int = 0
    salt: str = "primerl"  # the code book's key
    # one length: the word then sits at a fixed distance from where the call copies it, which the tiny model learns
    # about twice as fast as lengths 3-5 (experiments/code_lookup)
    min_len: int = 4
    max_len: int = 4
    stream: Literal["rl", "eval"] = "rl"


def words(seed: int, stream: str, min_len: int, max_len: int):
    """An endless, seeded stream of random words of distinct lowercase letters. A word's hash puts it on the training
    side (streams "rl" and "sft") or the held-out side ("eval") of a fixed split, so no held-out word is trained on."""
    rng = random.Random(f"{seed}/code-lookup/{stream}")
    while True:
        word = "".join(
            rng.sample(LETTERS, rng.randint(min_len, max_len))
        )  # distinct letters, as primerl-reverse-text's
        if (hash_bit(word) == 0) == (stream != "eval"):
            yield word


def hash_bit(word: str) -> int:
    return int(code_of(word, "split")) % 2


def prompt(word: str) -> str:
    return f"What is the code for {word}?"


class CodeLookupTaskset(vf.Taskset[CodeLookupTask, CodeLookupConfig]):
    INFINITE = True

    @classmethod
    def toolsets(cls, config: CodeLookupConfig) -> list[vf.Toolset]:
        return [CodeBook(CodeBookConfig(salt=config.salt))]

    def load(self):
        cfg = self.config
        for word in words(cfg.seed, cfg.stream, cfg.min_len, cfg.max_len):
            data = CodeLookupData(
                prompt=prompt(word), system_prompt=SYSTEM_PROMPT, word=word, code=code_of(word, cfg.salt)
            )
            yield CodeLookupTask(data, cfg.task)


def tool_schemas(toolset: vf.Toolset) -> list[dict]:
    """The toolset's tools as the harness offers them (verifiers' `connect_mcp` format), read from an in-process MCP
    server, so demonstrations show the model exactly the prompt it sees in rollouts."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("schemas")
    toolset.register(server)
    tools = asyncio.run(server.list_tools())
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in tools
    ]


def demonstrations(count: int, seed: int, env_args: dict) -> list[dict]:
    """primerl's SFT hook (primerl.envs.demonstrations): `count` conversations ({"messages", "tools"}) from the imperfect
    teacher, each asking DEMO_QUESTIONS words in turn, on words of the training side of the split (never a held-out
    word) drawn from their own seeded stream. Of `env_args`, the code book's `salt` and the word lengths count."""
    cfg = CodeLookupConfig(seed=seed, **{k: env_args[k] for k in ("salt", "min_len", "max_len") if k in env_args})
    salt = cfg.salt
    tools = tool_schemas(CodeBook(CodeBookConfig(salt=salt)))
    rng = random.Random(f"{seed}/code-lookup/teacher")
    stream = words(seed, "sft", cfg.min_len, cfg.max_len)
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for _ in range(DEMO_QUESTIONS):
            messages += teacher_turns(next(stream), rng.random(), salt)
        rows.append({"messages": messages, "tools": tools})
    return rows


def teacher_turns(word: str, behaviour: float, salt: str) -> list[dict]:
    """The question and the teacher's answer: a guess without the tool when `behaviour` < TEACHER_SKIPS, a look-up of
    the word without its last letter when below TEACHER_SKIPS + TEACHER_TYPOS, else the right look-up."""
    question = {"role": "user", "content": prompt(word)}
    if behaviour < TEACHER_SKIPS:
        return [question, {"role": "assistant", "content": TEACHER_GUESS}]
    looked_up = word[:-1] if behaviour < TEACHER_SKIPS + TEACHER_TYPOS else word
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"word": looked_up})},
    }
    code = code_of(looked_up, salt)
    return [
        question,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": code},
        {"role": "assistant", "content": code},
    ]


__all__ = ["CodeLookupTaskset", "ChatHarness", "demonstrations", "DEMONSTRATIONS_VERSION"]
