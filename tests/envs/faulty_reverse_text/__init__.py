"""`faulty-reverse-text` (tests only, on PYTHONPATH=tests/envs): primerl-reverse-text whose reward misbehaves by design.

For a task whose text hashes to 0, 1 or 2 (mod 8) the reward raises, hangs, or returns NaN; other tasks score as
in primerl-reverse-text. The orchestrator must count those rollouts as failed and keep training.

With `process_faults=true` (for env worker processes, primerl.envs.workers) a task whose text hashes to 3 or 4 (mod
32) also kills its process (`os._exit(3)`) or blocks its event loop (`time.sleep`, `block_s`): in the orchestrator's
own loop either would take the whole run down, in a worker only that worker's rollouts. With `fault_dir` each of
those two fires once per run (a marker file there says it has), so a run sees exactly one of each whatever the speed
of the machine; the other such tasks score as in primerl-reverse-text then. The reward faults fire on every task they hit: a
hung reward fails only its own rollout, at the rollout timeout, unless its worker is lost first.
"""

import asyncio
import os
import time
import zlib

import verifiers.v1 as vf
from primerl_chat import ChatHarness
from primerl_reverse_text import ReverseTextConfig, ReverseTextData, ReverseTextTaskset
from primerl_reverse_text.texts import lcs_ratio

from primerl.envs.trace_text import final_reply


def fault_of(text: str, process_faults: bool = False) -> str | None:
    crc = zlib.crc32(text.encode())
    if process_faults and crc % 32 in (3, 4):
        return {3: "exit", 4: "block"}[crc % 32]
    return {0: "raise", 1: "hang", 2: "nan"}.get(crc % 8)


class FaultyData(ReverseTextData):
    process_faults: bool = False
    block_s: float = 60.0
    fault_dir: str | None = None


def fires(fault: str, fault_dir: str | None) -> bool:
    """Whether a fault fires now: always without `fault_dir`, else only the first time (its marker file)."""
    if fault_dir is None:
        return True
    try:
        os.close(os.open(os.path.join(fault_dir, fault), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class FaultyTask(vf.Task[FaultyData]):
    @vf.reward
    async def lcs(self, task: FaultyData, trace: vf.Trace) -> float:
        fault = fault_of(task.text, task.process_faults)
        if fault == "raise":
            raise RuntimeError(f"reward function failed on purpose for {task.text!r}")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "nan":
            return float("nan")
        if fault == "exit" and fires(fault, task.fault_dir):
            os._exit(3)
        if fault == "block" and fires(fault, task.fault_dir):
            time.sleep(task.block_s)
        return lcs_ratio(final_reply(trace), task.text)


class FaultyConfig(ReverseTextConfig):
    process_faults: bool = False
    block_s: float = 60.0
    fault_dir: str | None = None


class FaultyReverseTextTaskset(vf.Taskset[FaultyTask, FaultyConfig]):
    """Declares its task type: an env worker rebuilds every task as the declared type."""

    @property
    def bounded(self) -> bool:
        return self.config.num_tasks is not None if self._bounded is None else self._bounded

    def load(self):
        for task in ReverseTextTaskset(self.config).load():
            data = FaultyData(
                **task.data.model_dump(),
                process_faults=self.config.process_faults,
                block_s=self.config.block_s,
                fault_dir=self.config.fault_dir,
            )
            yield FaultyTask(data, self.config.task)


__all__ = ["FaultyReverseTextTaskset", "ChatHarness"]
