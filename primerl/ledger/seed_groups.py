"""Runs that differ only in their seed, summarised together: what `primerl compare --by-seed` prints.

Per run: the held-out reward of each online eval (`eval/<env>/reward_mean`, by the policy version it was due at: an eval
due at a multiple of `eval.every` runs at the first version served at or past it, which can be a version or two later
when the replicas skip versions, so runs are compared mark by mark), the minutes from its first batch to its end, the
samples trained per second (batch size x trainer steps over the time between the first and the last trainer row), and
the minutes from its first batch to its first eval at or above a target and that eval's policy version, and the mean
over its rows of any metrics asked for (`--mean trainer/mismatch_kl`). Timed from the first batch, not the run's start,
so that the SFT warm-start (trained by the first run of a seed, read from the cache by the others) and the servers'
start do not count.
Per group of runs with the same settings but their seed: the mean and the range of each of those over the seeds.
"""

import statistics
from dataclasses import dataclass

REWARD_SUFFIX = "/reward_mean"
TRAINER_LOSS = "trainer/loss"
BATCH_REWARD = "orchestrator/reward/mean"  # one row per batch written


def setting_keys(runs: list, keys: list[str]) -> list[str]:
    """`keys` less `seed` and the keys that follow it (equal to the run's seed in every run: `env.args.seed`)."""
    return [k for k in keys if k != "seed" and any(r.data.params.get(k) != r.data.params.get("seed") for r in runs)]


@dataclass
class RunSummary:
    settings: tuple[str, ...]  # the values of the setting keys, in their order
    evals: dict[int, float]  # policy version -> held-out reward
    minutes: float | None
    samples_per_s: float | None
    minutes_to_target: float | None
    step_to_target: int | None  # the policy version of the first eval at or above the target
    means: dict[str, float | None]  # metric key -> the mean of its rows over the run (None: the run has none)


def eval_metric(run) -> str | None:
    """The run's first online-eval reward metric, if it has one."""
    return next((m for m in sorted(run.data.metrics) if m.startswith("eval/") and m.endswith(REWARD_SUFFIX)), None)


def run_mean(client, run, key: str) -> float | None:
    """The mean of metric `key`'s rows over the run, one value per step (the last one logged at a step)."""
    by_step = {
        m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
    }
    return statistics.mean(by_step.values()) if by_step else None


def due_evals(run, history: list) -> dict[int, float]:
    """Each eval's reward under the version it was due at: the multiple of `eval.every` at or below the version it
    ran on (the first one served at or past the mark), or `trainer.max_steps` for the last."""
    every = int(run.data.params.get("eval.every") or 0)
    last = int(run.data.params.get("trainer.max_steps") or -1)
    evals: dict[int, float] = {}
    for m in history:
        evals.setdefault(m.step if not every or m.step == last else m.step // every * every, m.value)
    return evals


def summarize(client, run, keys: list[str], target: float, means: tuple[str, ...] = ()) -> RunSummary:
    batches = client.get_metric_history(run.info.run_id, BATCH_REWARD)
    start, end = min((m.timestamp for m in batches), default=run.info.start_time), run.info.end_time
    metric = eval_metric(run)
    history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step) if metric else []
    reached = next((m for m in history if m.value >= target), None)
    steps = sorted(m.timestamp for m in client.get_metric_history(run.info.run_id, TRAINER_LOSS))
    batch_size = float(run.data.params.get("orchestrator.batch_size", "nan"))
    per_s = batch_size * (len(steps) - 1) / ((steps[-1] - steps[0]) / 1000) if len(steps) > 1 else None
    return RunSummary(
        settings=tuple(run.data.params.get(k, "-") for k in keys),
        evals=due_evals(run, history),
        minutes=(end - start) / 60_000 if end else None,
        samples_per_s=per_s if per_s and per_s > 0 else None,
        minutes_to_target=(reached.timestamp - start) / 60_000 if reached else None,
        step_to_target=reached.step if reached else None,
        means={key: run_mean(client, run, key) for key in means},
    )


def spread(values: list[float | None], digits: int = 3) -> str:
    """'mean [min, max]' of the values there are (`-` for none); `k/n` first when some runs have none."""
    have = [v for v in values if v is not None]
    if not have:
        return "-"
    shown = f"{statistics.mean(have):.{digits}g} [{min(have):.{digits}g}, {max(have):.{digits}g}]"
    return shown if len(have) == len(values) else f"{len(have)}/{len(values)}: {shown}"


def group(summaries: list[RunSummary]) -> dict[tuple[str, ...], list[RunSummary]]:
    groups: dict[tuple[str, ...], list[RunSummary]] = {}
    for summary in summaries:
        groups.setdefault(summary.settings, []).append(summary)
    return groups


def seed_table(groups: dict, keys: list[str], target: float, means: tuple[str, ...] = ()) -> list[list[str]]:
    """Rows (a header first) of the groups' summaries: one column per eval step any run has, then the times, then
    one per metric in `means` (its mean over each run's rows)."""
    steps = sorted({step for runs in groups.values() for r in runs for step in r.evals})
    header = [*keys, "seeds", *(f"eval v{s}" for s in steps), "minutes", "samples/s"]
    header += [f"minutes to eval >= {target:g}", f"step to eval >= {target:g}", *(f"mean {k}" for k in means)]
    rows = [header]
    for settings, runs in groups.items():
        rows.append(
            [
                *settings,
                str(len(runs)),
                *(spread([r.evals.get(s) for r in runs]) for s in steps),
                spread([r.minutes for r in runs]),
                spread([r.samples_per_s for r in runs]),
                spread([r.minutes_to_target for r in runs]),
                spread([r.step_to_target for r in runs]),
                *(spread([r.means.get(k) for r in runs]) for k in means),
            ]
        )
    return rows


def mean_curves(groups: dict, keys: list[str]) -> dict[str, list[tuple[int, float, float, float]]]:
    """label -> (step, mean, min, max) of the held-out reward over each group's seeds."""
    named = [k.rsplit(".", 1)[-1] for k in keys]
    curves = {}
    for settings, runs in groups.items():
        label = " ".join(f"{k}={v}" for k, v in zip(named, settings)) or "runs"
        steps = sorted({s for r in runs for s in r.evals})
        points = []
        for s in steps:
            values = [r.evals[s] for r in runs if s in r.evals]
            points.append((s, statistics.mean(values), min(values), max(values)))
        curves[label] = points
    return curves
