"""`primerl-reverse-text`: reverse a random lowercase string; reward = LCS ratio to the true reversal.

Tasks come from `primerl_reverse_text.texts` (the same generator SFT trains on), seeded by `seed`; training draws an unbounded
stream, `num_tasks` bounds it; `stream=eval` gives the held-out texts (`python -m primerl.eval`). `demonstrations` is
primerl's SFT hook (primerl.envs.demonstrations): reversals from their own text stream, some in capitals on request.
"""

import itertools
from typing import Literal

import verifiers.v1 as vf
from primerl_chat import ChatHarness

from primerl.envs.trace_text import final_reply
from primerl_reverse_text.texts import (
    MAX_LEN,
    MIN_LEN,
    SYSTEM_PROMPT,
    demonstration_answers,
    lcs_ratio,
    make_texts,
    prompt_messages,
    stream_seed,
)

DEMONSTRATIONS_VERSION = 1


class ReverseTextData(vf.TaskData):
    text: str = ""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward
    async def lcs(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return lcs_ratio(final_reply(trace), task.text)

    @vf.metric
    async def exact(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return float(final_reply(trace).strip() == task.text[::-1])


class ReverseTextConfig(vf.TasksetConfig):
    seed: int = 0
    min_len: int = MIN_LEN
    max_len: int = MAX_LEN
    num_tasks: int | None = None  # None: an endless stream
    stream: Literal["rl", "eval"] = (
        "rl"  # "rl": training tasks; "eval": the held-out texts (disjoint from RL and SFT of the same seed)
    )


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    @property
    def bounded(self) -> bool:
        return self.config.num_tasks is not None if self._bounded is None else self._bounded

    def load(self):
        cfg = self.config
        chunks = itertools.count() if cfg.num_tasks is None else range((cfg.num_tasks + 999) // 1000)
        produced = 0
        for chunk in chunks:
            for text in make_texts(stream_seed(cfg.seed, cfg.stream, chunk), 1000, cfg.min_len, cfg.max_len):
                if cfg.num_tasks is not None and produced >= cfg.num_tasks:
                    return
                produced += 1
                yield ReverseTextTask(ReverseTextData(prompt=text, system_prompt=SYSTEM_PROMPT, text=text), cfg.task)


def demonstrations(count: int, seed: int, env_args: dict, uppercase_fraction: float = 0.0) -> list[dict]:
    """`count` SFT conversations: a text of the "sft" stream (disjoint from the RL and eval streams) and its reversal,
    in capitals for a seeded `uppercase_fraction` of them. Text lengths as `env_args` give them."""
    lengths = int(env_args.get("min_len", MIN_LEN)), int(env_args.get("max_len", MAX_LEN))
    texts = make_texts(stream_seed(seed, "sft"), count, *lengths)
    answers = demonstration_answers(texts, uppercase_fraction, seed)
    return [{"messages": prompt_messages(t) + [{"role": "assistant", "content": a}]} for t, a in zip(texts, answers)]


__all__ = ["ReverseTextTaskset", "ChatHarness", "demonstrations", "DEMONSTRATIONS_VERSION"]
