"""`reverse-text`: reverse a random lowercase string; reward = LCS ratio to the true reversal.

Tasks come from `primerl.envs.reverse_text` (the same generator SFT trains on), seeded by `seed`; training
draws an unbounded stream, `num_tasks` bounds it; `stream=eval` gives the held-out texts (`python -m primerl.eval`).
"""

import itertools
from typing import Literal

import verifiers.v1 as vf
from primerl_chat import ChatHarness

from primerl.envs.reverse_text import SYSTEM_PROMPT, lcs_ratio, make_texts, stream_seed
from primerl.envs.traces import final_reply


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
    min_len: int = 3
    max_len: int = 8
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


__all__ = ["ReverseTextTaskset", "ChatHarness"]
