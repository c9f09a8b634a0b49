"""`primerl replay RUN_DIR [--steps A:B] [--out DIR] [OVERRIDES...]`: train a run's stored batches again and check
the result against the run's record.

No inference and no environments: this checkout's trainer, with the run's own overrides (`<run>/.hydra/
overrides.yaml`, plus any OVERRIDES given here: a trainer change to test against a recorded run), trains batches
A..B-1 into a new directory (default `<run>-replay`), starting from the weights the run started from (A = 0) or
from its STABLE checkpoint of step A. Then each step's loss, gradient norm, mismatch KL and entropy are compared with
the run's metrics rows, and the final weights with the run's published weights of step B (or its checkpoint).

On one machine with the same rank layout and trainer threads a replay is bit-exact: the batches carry everything
the loss reads, and the learning-rate schedule spans the run's trainer.max_steps (trainer.stop_at ends the replay).
Where it is not, the report names the first step that differs and by how much. Exit status: 0 all equal, 1 some
differ, 2 bad input (one line, nothing started).

The recorded overrides are data (primerl.recorded): one that is not a literal setting of primerl's schema is
refused with one line naming it, one whose value is code needs `--trust`, and a run directory another user owns or
can write is shown and asked about on a terminal, refused elsewhere, unless `--trust`.
"""

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from primerl.app import check
from primerl.config.schema import RunConfig
from primerl.launch.children import child_env, module_command
from primerl.launch.local import trainer_threads
from primerl.launch.start import sft_applies
from primerl.metrics import TRAINER, TrainerMetric, read_metrics
from primerl.recorded import UnsafeOverride, check_recorded, confirm, foreign_writer
from primerl.sft.cache import sft_checkpoint_dir
from primerl.transport.atomic import is_stable
from primerl.transport.run_dir import checkpoint_path, log_path, rollout_path, weights_path
from primerl.utils.errors import ConfigError

COMPARED = (TrainerMetric.LOSS, TrainerMetric.GRAD_NORM, TrainerMetric.MISMATCH_KL, TrainerMetric.ENTROPY)


class BadInput(Exception):
    pass


def recorded_overrides(run: Path, trusted: bool = False) -> list[str]:
    """The run's overrides but its output directory; BadInput when one is not a literal setting of the schema, or
    when another user wrote them and this user does not confirm (or `trusted`)."""
    path = run / ".hydra" / "overrides.yaml"
    if not path.exists():
        raise BadInput(f"{run} is not a primerl run directory (no .hydra/overrides.yaml)")
    overrides = [str(o) for o in yaml.safe_load(path.read_text()) or [] if not str(o).startswith("output_dir=")]
    try:
        check_recorded(overrides, trusted)
    except UnsafeOverride as err:
        raise BadInput(f"{path} holds an override a record may not carry: {err}") from None
    writer = None if trusted else foreign_writer(path)
    if writer is not None and not confirm(shlex.join(["primerl", "trainer", *overrides]), writer, str(path)):
        raise BadInput(f"{path} was written by {writer} (read it, then --trust)")
    return overrides


def step_range(run: Path, steps: str | None) -> tuple[int, int]:
    """[A, B): by default every step that has both its batch and its metrics row."""
    rows = {row["step"] for row in read_metrics(run, TRAINER)}
    recorded = 0
    while rollout_path(run, recorded).exists() and recorded in rows:
        recorded += 1
    if recorded == 0:
        raise BadInput(f"{run} has no trained batches to replay (rollouts/step_*.safetensors with metrics rows)")
    first, _, last = (steps or f"0:{recorded}").partition(":")
    start, end = int(first or 0), int(last or recorded)
    if not 0 <= start < end <= recorded:
        raise BadInput(f"--steps {steps}: the run has trained batches for steps 0..{recorded - 1}")
    if start and not is_stable(checkpoint_path(run, start)):
        raise BadInput(f"--steps {steps}: the run has no STABLE checkpoint of step {start} to start from")
    return start, end


def prepare(run: Path, out: Path, start: int, end: int) -> None:
    """The replay's directory: links to the run's batches start..end-1, and its checkpoint of `start`."""
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"{out} exists and is not empty: name another with --out")
    for step in range(start, end):
        target = rollout_path(out, step)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(rollout_path(run, step).resolve())
    if start:
        shutil.copytree(checkpoint_path(run, start), checkpoint_path(out, start))


def start_weights(cfg: RunConfig) -> None:
    """The weights a replay from step 0 starts from must be here: the SFT warm-start is not trained again."""
    if sft_applies(cfg) and not is_stable(sft_checkpoint_dir(cfg)):
        raise BadInput(
            f"the run started from the SFT warm-start {sft_checkpoint_dir(cfg)}, which is not in this cache: "
            "train it first (primerl sft with the run's overrides) or replay from a checkpoint (--steps A:B)"
        )


def train(run: Path, out: Path, cfg: RunConfig, overrides: list[str], end: int) -> None:
    # the files transport whatever the run used: a collective offer would wait for an orchestrator, which a replay has
    # not (and the math does not depend on how a version travels)
    overrides = [*overrides, f"trainer.stop_at={end}", "weights.transport=filesystem"]
    threads = trainer_threads(cfg)  # as the local launcher gives them: float sums depend on the thread count
    cmd = module_command("primerl.entrypoints.trainer", overrides, out, cfg.launcher.trainer_tasks_per_node)
    log = log_path(out, "trainer")
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"replay: training steps of {run} into {out} (log: {log})", flush=True)
    with open(log, "ab") as sink:
        if subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=child_env(threads=threads)).returncode:
            raise SystemExit(f"replay: the trainer failed; see {log}")


def compare_steps(run: Path, out: Path, start: int, end: int) -> list[str]:
    """One line per step that differs from the record."""
    recorded = {row["step"]: row for row in read_metrics(run, TRAINER)}
    replayed = {row["step"]: row for row in read_metrics(out, TRAINER)}
    lines = []
    for step in range(start, end):
        if step not in replayed:
            lines.append(f"step {step}: not trained by the replay")
            continue
        for key in COMPARED:
            was, now = recorded[step].get(key), replayed[step].get(key)
            if was != now:
                gap = abs(now - was) / max(abs(was), 1e-30) if None not in (was, now) else float("nan")
                lines.append(f"step {step}: {key} {was!r} recorded, {now!r} replayed (relative gap {gap:.2e})")
    return lines


def model_tensors(directory: Path) -> dict:
    """The model's tensors in a published weights directory or a checkpoint (names without "model.")."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= {k.removeprefix("model."): v for k, v in load_file(file).items() if not k.startswith("optim.")}
    return tensors


def compare_weights(run: Path, out: Path, end: int) -> list[str]:
    """One line when the final weights differ (or cannot be compared), none when they are equal."""
    for where in (weights_path, checkpoint_path):
        if not (is_stable(where(run, end)) and is_stable(where(out, end))):
            continue
        was, now = model_tensors(where(run, end)), model_tensors(where(out, end))
        if was.keys() != now.keys():
            return [f"weights of step {end}: other tensor names ({sorted(was.keys() ^ now.keys())[:3]})"]
        gaps = {k: float((was[k] - now[k]).abs().max()) for k in was if not torch.equal(was[k], now[k])}
        if not gaps:
            return []
        return [f"weights of step {end}: {len(gaps)} of {len(was)} tensors differ (max |gap| {max(gaps.values()):.2e})"]
    return [f"weights of step {end}: the run kept neither its published weights nor a checkpoint of that step"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="primerl replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, help="the recorded run's directory")
    parser.add_argument("--steps", help="A:B, the steps to replay (default: every trained step)")
    parser.add_argument("--out", type=Path, help="the replay's directory (default: <run>-replay)")
    parser.add_argument(
        "--trust", action="store_true", help="replay a run another user wrote, and settings that name code, unasked"
    )
    args, extra = parser.parse_known_args(argv)
    run = args.run.resolve()
    out = (args.out or run.with_name(f"{run.name}-replay")).resolve()
    try:
        overrides = [*recorded_overrides(run, args.trust), *extra]
        cfg = check([*overrides, f"output_dir={out}"])
        start, end = step_range(run, args.steps)
        if start == 0:
            start_weights(cfg)
        prepare(run, out, start, end)
    except (BadInput, ConfigError) as err:
        print(f"replay: {err}", file=sys.stderr)
        return 2
    train(run, out, cfg, overrides, end)
    differences = compare_steps(run, out, start, end) + compare_weights(run, out, end)
    for line in differences:
        print(f"replay: {line}")
    verdict = "differs from the record" if differences else "is bit-exact: every step and the final weights equal"
    print(f"replay: steps {start}..{end - 1} {verdict}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
