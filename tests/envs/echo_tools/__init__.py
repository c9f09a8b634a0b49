"""`echo-tools` (tests only): a verifiers env whose one MCP tool server knows nothing of primerl, run through the
`primerl-chat` harness by id. `echo(text)` answers its text; `sleep(seconds)` answers after a while (a slow tool).
Reward: 1 when the final reply equals the task's `expected`.
"""

import verifiers.v1 as vf
from primerl_chat import ChatHarness

from echo_tools.server import Echo, EchoConfig


class EchoData(vf.TaskData):
    expected: str = ""


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def matches(self, task: EchoData, trace: vf.Trace) -> float:
        replies = [m for m in (trace.branches[-1].messages if trace.branches else []) if m.role == "assistant"]
        return float(bool(replies) and str(replies[-1].content or "").strip() == task.expected)


class EchoTasksetConfig(vf.TasksetConfig):
    prompts: list[str] = ["hello"]


class EchoTaskset(vf.Taskset[EchoTask, EchoTasksetConfig]):
    @classmethod
    def toolsets(cls, config: EchoTasksetConfig) -> list[vf.Toolset]:
        return [Echo(EchoConfig())]

    def load(self):
        for text in self.config.prompts:
            yield EchoTask(EchoData(prompt=text, expected=text), self.config.task)


__all__ = ["EchoTaskset", "ChatHarness"]
