"""`faulty-reverse-text` (tests only, on PYTHONPATH=tests/envs): reverse-text whose reward misbehaves by design.

For a task whose text hashes to 0, 1 or 2 (mod 8) the reward raises, hangs, or returns NaN; other tasks score as
in reverse-text. The orchestrator must count those rollouts as failed and keep training.
"""

import asyncio
import zlib

import verifiers.v1 as vf
from primerl_chat import ChatHarness
from reverse_text import ReverseTextData, ReverseTextTaskset

from primerl.envs.reverse_text import lcs_ratio
from primerl.envs.traces import final_reply


def fault_of(text: str) -> str | None:
    return {0: "raise", 1: "hang", 2: "nan"}.get(zlib.crc32(text.encode()) % 8)


class FaultyTask(vf.Task[ReverseTextData]):
    @vf.reward
    async def lcs(self, task: ReverseTextData, trace: vf.Trace) -> float:
        fault = fault_of(task.text)
        if fault == "raise":
            raise RuntimeError(f"reward function failed on purpose for {task.text!r}")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "nan":
            return float("nan")
        return lcs_ratio(final_reply(trace), task.text)


class FaultyReverseTextTaskset(ReverseTextTaskset):
    def load(self):
        for task in super().load():
            yield FaultyTask(task.data, self.config.task)


__all__ = ["FaultyReverseTextTaskset", "ChatHarness"]
