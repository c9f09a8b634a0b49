"""The chaos soak's checks of a run after its faults (benchmarks/chaos.py): every step trained once, every batch
consumed once, the record complete, nothing left behind; with an env that resumes by replay, episodes continued."""

import collections
import json
import re
from pathlib import Path

from benchmarks.chaos_soak import RIDDEN, SAMPLE_EVERY, Soak
from primerl.launch.leftovers import run_processes
from primerl.metrics import EVAL, ORCHESTRATOR, TRAINER, read_metrics
from primerl.orchestrator.episodes import EPISODES_DIR
from primerl.transport.atomic import stale_temporaries
from primerl.transport.batches import read_rollout_batch
from primerl.transport.run_dir import rollout_path, samples_path, scratch_dirs


def check_steps(run: Path, steps: int, faults: list[dict]) -> list[tuple[str, bool, str]]:
    """Every step trained once, every batch consumed once, nothing rewound."""
    checks = []
    trainer_steps = [r["step"] for r in read_metrics(run, TRAINER)]
    checks.append(("trainer rows 0..steps-1 once", trainer_steps == list(range(steps)), f"{len(trainer_steps)} rows"))
    log = (run / "logs" / "trainer.log").read_text()
    reports = [
        line for line in log.splitlines() if "update skipped" not in line
    ]  # a NaN step's warning is not a report
    twice = [s for s in range(steps) if sum(f"trainer: step {s}:" in line for line in reports) > 1]
    starts = [
        int(line.split("trainer: starting at step ")[1].split()[0])
        for line in log.splitlines()
        if "trainer: starting at step " in line
    ]
    checks.append(("no step trained twice", not twice, f"trained twice: {twice or 'none'}"))
    # a start before the previous one only where a damaged checkpoint was set aside (the one before it is taken)
    rewinds = sum(later < earlier for earlier, later in zip(starts, starts[1:]))
    damaged = sum(f["kind"] == "damaged_checkpoint" for f in faults)
    checks.append(
        (
            "restarts resume, never rewind but past a damaged checkpoint",
            rewinds <= damaged and starts[0] == 0,
            f"trainer starts at {starts}",
        )
    )
    set_aside = len(list((run / "checkpoints").glob("damaged-step_*")))
    checks.append(
        ("each damaged checkpoint set aside", set_aside == damaged, f"{set_aside} set aside, {damaged} damaged")
    )
    skipped, nans = log.count("not finite: update skipped"), sum(f["kind"] == "nan_step" for f in faults)
    checks.append(("one skipped update per NaN step", skipped == nans, f"{skipped} skipped, {nans} NaN steps"))
    orch_steps = [r["step"] for r in read_metrics(run, ORCHESTRATOR)]
    checks.append(("batches 0..steps-1 once", orch_steps == list(range(steps)), f"{len(orch_steps)} rows"))
    olog = (run / "logs" / "orchestrator.log").read_text()
    batches = [read_rollout_batch(rollout_path(run, s)) for s in range(steps)]
    positions = [b.data_position for b in batches]
    counted = collections.Counter(i for b in batches for i in b.tasks_trained + b.tasks_spent)
    twice = sorted(i for i, n in counted.items() if n > 1)
    missing = sorted(set(range(positions[-1])) - set(counted) - set(batches[-1].tasks_pending))
    checks.append(
        (
            "every drawn task trained or spent once, or pending at the end",
            not twice and not missing,
            f"{positions[-1]} drawn: {len(counted)} accounted, {len(batches[-1].tasks_pending)} pending; "
            f"twice {twice[:10] or 'none'}, lost {missing[:10] or 'none'}",
        )
    )
    equal = sum(a == b for a, b in zip(positions, positions[1:]))
    checks.append(
        (
            "data positions never rewound",
            positions == sorted(positions),
            f"{positions[0]}..{positions[-1]}, {equal} equal neighbours",
        )
    )
    evals = [r["step"] for r in read_metrics(run, EVAL)]
    evaluated = "no online evals" not in olog  # an env without a held-out split has none
    checks.append(
        (
            "online evals once per version",
            evals == sorted(set(evals)) and evals[:1] == [0] and evals[-1:] == [steps] or not evaluated and not evals,
            f"at policy versions {evals}" if evaluated else "none: the env has no held-out split",
        )
    )
    resumes = olog.count("resuming at step")  # a soak of ridden faults alone never restarts the run
    restarted = any(f["kind"] not in RIDDEN for f in faults)
    checks.append(("orchestrator resumed", resumes >= 1 or not restarted, f"{resumes} resumes"))
    back, kills = olog.count(" is back, serving v"), sum(f["kind"].startswith("vllm") for f in faults)
    checks.append(("a killed vLLM server came back each time", back >= kills, f"{back} returns, {kills} kills"))
    return checks


def check_record(run: Path, steps: int, faults: list[dict]) -> list[tuple[str, bool, str]]:
    """The MLflow record complete: FINISHED, each metric row once, one trace per sampled rollout; torn lines skipped."""
    from mlflow.tracking import MlflowClient

    record = json.loads((run / "ledger.json").read_text())
    client = MlflowClient(record["tracking_uri"])
    checks = [("MLflow run FINISHED", (status := client.get_run(record["run_id"]).info.status) == "FINISHED", status)]
    finite = [r["step"] for r in read_metrics(run, TRAINER) if r["loss"] is not None]  # a NaN step's loss: no point
    for name, want in (("trainer/loss", finite), ("orchestrator/reward/mean", list(range(steps)))):
        history = sorted(m.step for m in client.get_metric_history(record["run_id"], name))
        checks.append((f"{name} once per step with a value", history == want, f"{len(history)} points"))
    sampled, torn = [], 0
    for line in samples_path(run).read_text().splitlines():
        try:
            sampled.append(json.loads(line))
        except ValueError:
            torn += 1
    tears = sum(f["kind"] == "torn_samples" for f in faults)
    checks.append(("each torn samples line alone, skipped", torn == tears, f"{torn} bad lines, {tears} torn"))
    expected = len([s for s in sampled if s["step"] % SAMPLE_EVERY == 0])
    traces, token = 0, None
    while True:  # pages of at most 100, as a tracking server serves them
        page = client.search_traces(
            locations=[record["experiment_id"]], run_id=record["run_id"], page_token=token, include_spans=False
        )
        traces, token = traces + len(page), page.token
        if not token:
            break
    checks.append(("one trace per sampled rollout", traces == expected, f"{traces} traces, {expected} rows"))
    return checks


def check_faults(soak: Soak) -> list[tuple[str, bool, str]]:
    """Nothing left behind; the run rode through every fault it should; every second run refused at once."""
    run = soak.run
    checks = [("no orphans after any kill", not soak.orphans, "; ".join(soak.orphans) or "none")]
    checks.append(("no process of the run left", not run_processes(run), str(run_processes(run) or "none")))
    stale = stale_temporaries(run) + scratch_dirs(run)
    checks.append(("no stray temporaries", not stale, ", ".join(map(str, stale)) or "none"))
    for kind in RIDDEN:
        ridden = [f for f in soak.faults if f["kind"] == kind]
        detail = ", ".join(f"{f['recovered_s']} s ({f['steps_during']} during)" for f in ridden) or "none"
        checks.append((f"the run went on through every {kind}", all(f["went_on"] for f in ridden), detail))
    reruns = [f for f in soak.faults if f["kind"] == "store_down_at_start"]
    checks.append(
        (
            "each rerun without its tracking server waited for it and went on",
            all(f["waited_for_store"] for f in reruns),
            f"{sum(f['waited_for_store'] for f in reruns)} of {len(reruns)}",
        )
    )
    deaths = [f for f in soak.faults if f["kind"] == "dies_at_first_request"]
    checks.append(
        (
            "a server dying at each first request stopped the run, its error quoted",
            all(f["quoted"] and f["driver_exit"] == 1 for f in deaths),
            f"{sum(f['quoted'] for f in deaths)} of {len(deaths)} quoted; exits {[f['driver_exit'] for f in deaths]}",
        )
    )
    seconds = [f["second"] for f in soak.faults if "second" in f]
    checks.append(
        (
            "second runs refused at once, nothing of them left",
            all(s["refused"] and not s["left"] for s in seconds),
            "; ".join(f"exit {s['exit']} after {s['seconds']} s: {s['line']}" for s in seconds) or "none",
        )
    )
    return checks


SERVED_LINE = re.compile(r"episode (task\d+-\d+): a turn served from its journal")
KEPT_LINE = re.compile(r"task (\d+): (\d+) finished turn\(s\) kept in \d+ episode journal\(s\), sampled by (\S+):")


def check_episodes(run: Path, steps: int) -> list[tuple[str, bool, str]]:
    """With an env that resumes by replay (primerl.envs.episode_journal): the rollouts a kill cut short found their
    finished turns after it and continued from them (served from the journals), or, where those turns were too stale
    for the batch the task would land in, ran afresh; and no journal outlived its task. Which of the two depends on
    how far the trainer got meanwhile. Nothing to check for other envs."""
    journals = run / EPISODES_DIR
    if not journals.is_dir():
        return []
    olog = (run / "logs" / "orchestrator.log").read_text()
    kept = KEPT_LINE.findall(olog)
    afresh = olog.count("kept turn(s) go back to policy")
    per_episode = collections.Counter(SERVED_LINE.findall(olog))  # turns served again, per rollout
    served = sum(per_episode.values())
    example = ", ".join(f"task {task}: {turns} turn(s) by {versions}" for task, turns, versions in kept[:3])
    went_on_at = sorted(collections.Counter(n + 1 for n in per_episode.values()).items())
    last = read_rollout_batch(rollout_path(run, steps - 1))
    left = [
        path.name
        for path in journals.glob("task*-*.jsonl")
        if (task := int(path.name[4:].split("-")[0])) not in last.tasks_pending and task < last.data_position
    ]
    return [
        (
            "rollouts cut by a kill continued at their next turn, or afresh where too stale",
            bool(kept or afresh) and (served >= 1 or not kept),
            f"{len(kept)} task(s) with {sum(int(t) for _, t, _ in kept)} turn(s) kept ({example or 'none'}), "
            f"{afresh} task(s) sampled afresh; "
            f"{served} turn(s) served from journals, not sampled again; rollouts by the turn they went on live at: "
            f"{', '.join(f'turn {turn}: {n}' for turn, n in went_on_at) or 'none'}",
        ),
        ("no journal outlived its task", not left, f"left: {left[:5] or 'none'}"),
    ]
