"""`primerl replay`: a recorded run's batches trained again by this checkout's trainer reproduce every step's loss
and gradient norm and the final weights bit for bit (same machine, ranks and threads), from the start or from a
checkpoint; a changed trainer setting is reported at the first step it changes; bad input is one line."""

import subprocess
import sys

import pytest
import yaml

from primerl.app import check
from primerl.model.resolve import prepare_base_model
from primerl.orchestrator.batch import build_batch
from primerl.transport.batches import write_rollout_batch
from tests.conftest import ROOT, model_samples, run_module

pytestmark = pytest.mark.slow

OVERRIDES = [
    "+experiment=reverse_text",
    "sft.enabled=false",
    "trainer.max_steps=3",
    "trainer.keep_checkpoints=3",
    "trainer.lr_schedule.type=cosine",
    "launcher.trainer_threads=1",
]


def _replay(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "primerl.cli", "replay", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def recorded(cache_dir, tmp_path_factory):
    """A run of 3 trainer steps on stored batches, with its overrides recorded as the driver records them."""
    run = tmp_path_factory.mktemp("recorded") / "run"
    overrides = [*OVERRIDES, f"cache_dir={cache_dir}"]
    cfg = check([*overrides, f"output_dir={run}"])
    samples = model_samples(prepare_base_model(cfg.model, cfg.cache_dir), n=12)
    for step in range(3):
        batch = build_batch(samples, step, seq_len=512, micro_batch_size=8, pad_id=0, temperature=1.0, async_level=1)
        write_rollout_batch(run, batch)
    result = run_module("primerl.entrypoints.trainer", *overrides, f"output_dir={run}", f"hydra.run.dir={run}/logs")
    assert result.returncode == 0, result.stderr[-3000:]
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return run


def test_a_replay_is_bit_exact_from_the_start_and_from_a_checkpoint(recorded, tmp_path):
    # a collective run's replay publishes files: it never waits for an orchestrator to take an offer
    whole = _replay(str(recorded), "--out", str(tmp_path / "whole"), "weights.transport=collective")
    assert whole.returncode == 0, whole.stdout + whole.stderr[-2000:]
    assert "steps 0..2 is bit-exact" in whole.stdout
    tail = _replay(str(recorded), "--steps", "1:3", "--out", str(tmp_path / "tail"))
    assert tail.returncode == 0, tail.stdout + tail.stderr[-2000:]
    assert "steps 1..2 is bit-exact" in tail.stdout


def test_a_changed_trainer_is_reported_at_the_first_step_it_changes(recorded, tmp_path):
    changed = _replay(str(recorded), "--out", str(tmp_path / "changed"), "trainer.optim.lr=1e-3")
    assert changed.returncode == 1, changed.stdout + changed.stderr[-2000:]
    found = [line for line in changed.stdout.splitlines() if line.startswith("replay: step ")]
    # step 0 trains the same start weights, so its loss and gradient equal the record's; step 1 does not
    assert found and found[0].startswith("replay: step 1: loss "), changed.stdout
    assert "tensors differ" in changed.stdout and "differs from the record" in changed.stdout


def test_bad_input_is_one_line(recorded, tmp_path):
    for args, message in [
        ((str(tmp_path),), "is not a primerl run directory"),
        ((str(recorded), "--steps", "0:9"), "the run has trained batches for steps 0..2"),
        ((str(recorded), "--out", str(recorded)), "exists and is not empty"),
    ]:
        result = _replay(*args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
