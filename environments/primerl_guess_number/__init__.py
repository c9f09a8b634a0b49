"""`primerl-guess-number`: a multi-turn game. The policy guesses a secret integer in [1, high]; after each guess the env
answers "higher", "lower" or "correct". Reward: 1 - (guesses - 1) / max_turns when solved, else 0.
"""

import random
import re

import verifiers.v1 as vf
from primerl_chat import ChatHarness

SYSTEM_PROMPT = "Guess the secret number. Answer with a number only."


class GuessData(vf.TaskData):
    secret: int = 1
    high: int = 16
    max_turns: int = 5


def guesses(trace: vf.Trace) -> list[int | None]:
    """The integer in each assistant message, in order (None where there is none)."""
    if not trace.branches:
        return []
    out = []
    for message in trace.branches[-1].messages:
        if message.role == "assistant":
            match = re.search(r"-?\d+", str(message.content or ""))
            out.append(int(match.group()) if match else None)
    return out


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "Not a number. Guess again."
    if guess == secret:
        return "correct"
    return "higher" if guess < secret else "lower"


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        made = guesses(trace)
        if task.secret not in made:
            return 0.0
        return 1.0 - made.index(task.secret) / task.max_turns

    @vf.metric
    async def turns(self, task: GuessData, trace: vf.Trace) -> float:
        return float(len(guesses(trace)))


class GuessConfig(vf.TasksetConfig):
    seed: int = 0
    high: int = 16
    max_turns: int = 5


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    INFINITE = True

    def load(self):
        rng = random.Random(f"{self.config.seed}/guess-number")
        while True:
            secret = rng.randint(1, self.config.high)
            prompt = f"The number is between 1 and {self.config.high}."
            yield GuessTask(
                GuessData(
                    prompt=prompt,
                    system_prompt=SYSTEM_PROMPT,
                    secret=secret,
                    high=self.config.high,
                    max_turns=self.config.max_turns,
                ),
                self.config.task,
            )


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    """The env is the control flow: it reads each guess and answers until solved or out of turns. Its episode is a
    function of the task and the guesses, so replaying the guesses rebuilds it: a rollout cut short continues from its
    last finished turn (primerl.envs.episode_journal)."""

    RESUMES_BY_REPLAY = True

    async def run(self, task, agents):
        data: GuessData = task.data
        async with agents.agent.interaction(task) as game:
            segment = await game.turn()
            for _ in range(data.max_turns - 1):
                if segment.terminated:
                    break
                made = guesses(game.trace)
                reply = feedback(made[-1] if made else None, data.secret)
                if reply == "correct":
                    break
                segment = await game.turn(reply)


__all__ = ["GuessTaskset", "GuessEnv", "ChatHarness"]
