"""The primerl-reverse-text task: texts, prompts and the LCS-ratio reward, defined once for the env's tasks, its SFT
demonstrations and the envs built on it (primerl-long-tail). Imports no verifiers."""

import random
import string

SYSTEM_PROMPT = "Reverse the text."


def stream_seed(seed: int, stream: str, chunk: int = 0) -> str:
    """Seeds of disjoint text streams for one run seed: "sft" (training pairs), "eval" (held out), "rl" (tasks)."""
    return f"{seed}/{stream}/{chunk}"


ALPHABET = string.ascii_lowercase
MIN_LEN, MAX_LEN = 3, 8  # text lengths, in letters, unless the env's args say otherwise


def make_texts(seed: int | str, count: int, min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> list[str]:
    """`count` random strings of distinct lowercase letters; the same seed always gives the same list.

    Letters do not repeat within a text, so every output position has one unambiguous source position: a tiny
    model learns the reversal in minutes on a CPU instead of stalling on the letter-frequency plateau.
    """
    if not 1 <= min_len <= max_len <= len(ALPHABET):
        raise ValueError(f"need 1 <= min_len <= max_len <= {len(ALPHABET)}, got {min_len}, {max_len}")
    rng = random.Random(seed)
    return ["".join(rng.sample(ALPHABET, rng.randint(min_len, max_len))) for _ in range(count)]


def prompt_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]


def demonstration_answers(texts: list[str], uppercase_fraction: float, seed: int) -> list[str]:
    """The SFT answer for each text: its reversal, in capitals for a seeded `uppercase_fraction` of them (a sloppy
    teacher, so the warm-start has a habit for RL to unlearn: the reward is case-sensitive)."""
    if not 0 <= uppercase_fraction < 1:
        raise ValueError(f"uppercase_fraction must be >= 0 and < 1, got {uppercase_fraction}")
    rng = random.Random(f"{seed}/sft-uppercase")
    return [t[::-1].upper() if rng.random() < uppercase_fraction else t[::-1] for t in texts]


def lcs_length(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(completion: str, text: str) -> float:
    """2*LCS/(len(a)+len(b)) between the completion and the true reversal: 1.0 iff exact, 0.0 for nothing shared."""
    target = text[::-1]
    answer = completion.strip()
    if not answer and not target:
        return 1.0
    return 2 * lcs_length(answer, target) / (len(answer) + len(target))
