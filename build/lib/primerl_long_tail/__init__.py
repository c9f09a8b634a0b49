"""`primerl-long-tail`: multi-turn primerl-reverse-text whose episodes have heavy-tailed turn counts, as agentic tasks do.

Each task is a chain of texts to reverse, one per turn: the env shows the next text after each answer. Most chains are
one text long; a `tail_fraction` of them are `max_turns` long, the rest 2-4. In a batch of 8 tasks the slowest episode
then runs about `max_turns` times as long as the median one. Reward: the mean LCS ratio of the answers to the true
reversals (a missing answer scores 0). Metric `turns`: answers given. It exists to measure what waiting for the
slowest episode of a batch costs (benchmarks/long_tail.py); the primerl-reverse-text SFT checkpoint plays it.
"""

import random

import verifiers.v1 as vf
from primerl_chat import ChatHarness
from primerl_reverse_text.texts import MAX_LEN, MIN_LEN, SYSTEM_PROMPT, lcs_ratio, make_texts

from primerl.envs.trace_text import final_reply


class ChainData(vf.TaskData):
    texts: list[str] = []


def answers(trace: vf.Trace) -> list[str]:
    if not trace.branches:
        return []
    return [str(m.content or "") for m in trace.branches[-1].messages if m.role == "assistant"]


class ChainTask(vf.Task[ChainData]):
    @vf.reward
    async def lcs(self, task: ChainData, trace: vf.Trace) -> float:
        given = answers(trace) or [final_reply(trace)]
        return sum(lcs_ratio(a, t) for a, t in zip(given, task.texts)) / len(task.texts)

    @vf.metric
    async def turns(self, task: ChainData, trace: vf.Trace) -> float:
        return float(len(answers(trace)))


class LongTailConfig(vf.TasksetConfig):
    seed: int = 0
    max_turns: int = 8  # the tail: a chain this long
    tail_fraction: float = 0.2  # of tasks in the tail; half of all tasks are one turn long
    min_len: int = MIN_LEN
    max_len: int = MAX_LEN


def chain_length(rng: random.Random, max_turns: int, tail_fraction: float) -> int:
    u = rng.random()
    if u < tail_fraction:
        return max_turns
    if u < tail_fraction + 0.5:
        return 1
    return rng.randint(2, max(2, min(4, max_turns - 1)))


class LongTailTaskset(vf.Taskset[ChainTask, LongTailConfig]):
    INFINITE = True

    def load(self):
        cfg = self.config
        rng = random.Random(f"{cfg.seed}/long-tail")
        for chunk in range(10**9):
            texts = iter(make_texts(f"{cfg.seed}/long-tail/{chunk}", 1000 * cfg.max_turns, cfg.min_len, cfg.max_len))
            for _ in range(1000):
                chain = [next(texts) for _ in range(chain_length(rng, cfg.max_turns, cfg.tail_fraction))]
                yield ChainTask(ChainData(prompt=chain[0], system_prompt=SYSTEM_PROMPT, texts=chain), cfg.task)


class LongTailEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class LongTailEnv(vf.Env[LongTailEnvConfig]):
    """The env is the control flow: after each answer it shows the chain's next text."""

    async def run(self, task, agents):
        data: ChainData = task.data
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for text in data.texts[1:]:
                if segment.terminated:
                    break
                segment = await chat.turn(text)


__all__ = ["LongTailTaskset", "LongTailEnv", "ChatHarness"]
