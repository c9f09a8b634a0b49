"""The trainer process on bad input and a failing disk: non-finite steps are skipped then stop the run, a corrupt batch
file is refused, a failed checkpoint write leaves nothing marked STABLE. Each ends with one line and exit 1."""

import logging
import math
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from primerl.app import check
from primerl.metrics import read_metrics
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.batch import build_batch
from primerl.trainer.checkpoint import latest_checkpoint
from primerl.transport.batches import write_rollout_batch
from primerl.transport.run_dir import checkpoint_path, checkpoints_root, rollout_path, weights_path, weights_root
from tests.conftest import ROOT, model_samples

pytestmark = pytest.mark.slow


def _args(cache_dir, run, steps: int) -> list[str]:
    return [
        "+experiment=reverse_text",
        "sft.enabled=false",
        f"trainer.max_steps={steps}",
        f"cache_dir={cache_dir}",
        f"output_dir={run}",
        f"hydra.run.dir={run}/logs",
    ]


def _write_batches(cache_dir, run, advantages: list[float | None]) -> None:
    """Batch n from the model's own samples; advantage None: mixed signs, NaN: a batch whose loss is NaN."""
    cfg = check(_args(cache_dir, run, len(advantages)))
    model = prepare_base_model(cfg.model, cfg.cache_dir)
    for step, advantage in enumerate(advantages):
        samples = model_samples(model, n=8, advantage=advantage)
        write_rollout_batch(
            run, build_batch(samples, step, seq_len=128, micro_batch_size=4, pad_id=0, temperature=1.0, async_level=1)
        )


def _trainer(args: list[str], file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit():  # a write past the limit fails with EFBIG, as one past a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        [sys.executable, "-m", "primerl.entrypoints.trainer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit if file_size_limit else None,
    )


def _one_line_error(result, fragment: str) -> None:
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and fragment in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_nonfinite_steps_are_skipped_and_three_in_a_row_stop_the_run(cache_dir, tmp_path, caplog):
    from primerl.launch.progress import Progress

    nan = math.nan
    _write_batches(cache_dir, tmp_path, [None, nan, None, nan, nan, nan])
    result = _trainer(_args(cache_dir, tmp_path, 6))
    _one_line_error(result, "3 steps in a row had a non-finite loss or gradient norm (last: step 5)")
    rows = read_metrics(tmp_path, "trainer")
    assert [r["update_skipped"] for r in rows] == [0, 1, 0, 1, 1]  # step 5 stopped the run before its row
    assert "step 1: loss nan" in result.stderr and "update skipped (1 in a row" in result.stderr
    assert math.isfinite(rows[2]["loss"]) and rows[2]["grad_norm"] > 0  # a finite step between them trained
    # the trainer keeps the newest 3 versions: v3 (after finite step 2), v4 and v5 (after NaN steps 3 and 4)
    weights = {v: load_file(weights_path(tmp_path, v) / "model.safetensors") for v in (3, 4, 5)}
    for v in (4, 5):  # a NaN step changed nothing
        assert all(torch.equal(weights[v][k], weights[3][k]) for k in weights[3])
    assert all(torch.isfinite(t).all() for t in weights[3].values())
    assert latest_checkpoint(tmp_path) == 5 and not weights_path(tmp_path, 6).exists()
    # the driver's progress lines over these rows: the skipped steps show nan, and nothing stops it
    caplog.set_level(logging.INFO)
    progress = Progress(tmp_path, check(_args(cache_dir, tmp_path, 6)))
    progress.poll()
    assert progress.steps_shown == 5
    assert "step 2/6  reward nan  loss nan" in caplog.text and "step 3/6" in caplog.text


def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(cache_dir, tmp_path):
    """A checkpoint the shared filesystem delivered truncated: the trainer says so, resumes from the one before it,
    trains the steps since again from their stored batches (their first metrics rows kept) and sets the damaged one
    aside; with every checkpoint damaged it stops with one line."""
    _write_batches(cache_dir, tmp_path, [None] * 4)
    assert _trainer(_args(cache_dir, tmp_path, 3)).returncode == 0
    assert latest_checkpoint(tmp_path) == 3
    trained = read_metrics(tmp_path, "trainer")

    def truncate(step: int) -> None:
        largest = max(checkpoint_path(tmp_path, step).iterdir(), key=lambda p: p.stat().st_size)
        os.truncate(largest, largest.stat().st_size // 2)

    truncate(3)
    again = _trainer(_args(cache_dir, tmp_path, 4))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "step_000003 is corrupt" in again.stderr and "resuming from the checkpoint before it" in again.stderr
    assert "starting at step 2 from" in again.stdout + again.stderr
    assert [p.name.split("-")[:2] for p in checkpoints_root(tmp_path).glob("damaged-*")] == [["damaged", "step_000003"]]
    rows = read_metrics(tmp_path, "trainer")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[:3] == trained  # step 2 trained again, its row kept
    assert latest_checkpoint(tmp_path) == 4
    for step in (3, 4):
        truncate(step)
    stopped = _trainer(_args(cache_dir, tmp_path, 5))
    _one_line_error(stopped, "no sound checkpoint to resume from")


def test_a_corrupt_batch_is_refused(cache_dir, tmp_path):
    _write_batches(cache_dir, tmp_path, [None])
    path = rollout_path(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the last tensor
    path.write_bytes(bytes(data))
    result = _trainer(_args(cache_dir, tmp_path, 1))
    _one_line_error(result, "rollout batch")
    assert "is corrupt (its data or metadata does not match its recorded sha256)" in result.stderr
    assert read_metrics(tmp_path, "trainer") == [] and latest_checkpoint(tmp_path) is None


def test_a_failed_write_leaves_nothing_stable(cache_dir, tmp_path):
    _write_batches(cache_dir, tmp_path, [None])
    result = _trainer(_args(cache_dir, tmp_path, 1), file_size_limit=256 * 1024)  # the checkpoint is ~10 MB
    _one_line_error(result, "could not write the checkpoint and weights of step 1")
    assert "nothing of it is marked STABLE" in result.stderr
    for root in (checkpoints_root(tmp_path), weights_root(tmp_path)):  # no STABLE directory, no leftover staging
        assert not root.exists() or list(root.iterdir()) == [], list(root.iterdir())


def test_a_failed_background_checkpoint_write_stops_the_run_at_the_next_save(cache_dir, tmp_path):
    """trainer.checkpoint_async: the checkpoint (~10 MB) fails past a 5 MB limit in the writer thread while the
    weights (~3 MB) publish. The failure surfaces as one line when the next save waits for it; the step it was
    written for has its metrics row and published weights, and nothing of the checkpoint is STABLE."""
    _write_batches(cache_dir, tmp_path, [None, None, None])
    result = _trainer(_args(cache_dir, tmp_path, 3), file_size_limit=5 * 1024 * 1024)
    _one_line_error(result, "could not write the checkpoint of step 1")
    assert "it is not marked STABLE" in result.stderr
    assert latest_checkpoint(tmp_path) is None and not list(checkpoints_root(tmp_path).glob(".*partial"))
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")][:1] == [0]
    assert weights_path(tmp_path, 1).exists()
