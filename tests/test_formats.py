"""Checkpoints and run directories outlive a release (primerl.transport.formats): a small run directory written by
format 1 is kept in the repository (tests/data/run_format_1) and resumed here by this release's trainer; another
format is refused with one line naming both.

A change that breaks resume fails `test_the_kept_run_directory_resumes`. If the break is intended, bump the format
number in primerl/transport/formats.py and write the fixture again:

    python -m tests.test_formats tests/data/run_format_<new number>
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from primerl.app import check
from primerl.launch.resume import check_resume, check_run_format
from primerl.metrics import read_metrics
from primerl.trainer.checkpoint import latest_checkpoint, verify_checkpoint
from primerl.transport.formats import CHECKPOINT_FORMAT, RUN_DIR_FORMAT, UnreadableFormat
from primerl.transport.run_dir import checkpoint_path, run_format_path
from tests.conftest import ROOT, run_module

pytestmark = pytest.mark.slow

FIXTURE = ROOT / "tests" / "data" / f"run_format_{RUN_DIR_FORMAT}"
# a model of ~7k parameters keeps the kept checkpoint (weights and AdamW moments) near 100 KB
OVERRIDES = [
    "+experiment=reverse_text",
    "sft.enabled=false",
    "model.arch.hidden_size=16",
    "model.arch.num_hidden_layers=1",
    "model.arch.num_attention_heads=2",
    "model.arch.num_key_value_heads=1",
    "model.arch.head_dim=8",
    "model.arch.intermediate_size=32",
    "trainer.seq_len=128",
    "inference.max_model_len=128",
    "trainer.micro_batch_size=4",
]


def _trainer(run: Path, cache_dir: Path, steps: int):
    args = [*OVERRIDES, f"trainer.max_steps={steps}", f"output_dir={run}", f"hydra.run.dir={run}/logs"]
    return run_module("primerl.entrypoints.trainer", *args, f"cache_dir={cache_dir}", timeout=300)


def write_fixture(run: Path, cache_dir: Path) -> None:
    """The kept run directory: batches 0 and 1, one trained step (its checkpoint and metrics row), the settings and
    format files; no published weights (a resume publishes what is missing) and no logs."""
    from primerl.model.resolve import prepare_base_model
    from primerl.orchestrator.batch import build_batch
    from primerl.transport.batches import write_rollout_batch
    from tests.conftest import model_samples

    cfg = check([*OVERRIDES, f"output_dir={run}", f"cache_dir={cache_dir}"])
    samples = model_samples(prepare_base_model(cfg.model, cfg.cache_dir), n=8)
    for step in (0, 1):
        batch = build_batch(samples, step, seq_len=128, micro_batch_size=4, pad_id=0, temperature=1.0, async_level=1)
        write_rollout_batch(run, batch)
    result = _trainer(run, cache_dir, steps=1)
    assert result.returncode == 0, result.stderr[-3000:]
    check_resume(cfg, run)  # run_settings.json and format.json, as the driver writes them
    for name in ("logs", "weights"):
        shutil.rmtree(run / name)


def test_the_kept_run_directory_resumes(cache_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    check_run_format(run)  # the driver's check (its settings check is about the config, not the format)
    assert verify_checkpoint(checkpoint_path(run, 1))["format"] == CHECKPOINT_FORMAT
    result = _trainer(run, cache_dir, steps=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"starting at step 1 from {checkpoint_path(run, 1)}" in result.stdout
    assert [row["step"] for row in read_metrics(run, "trainer")] == [0, 1]
    assert latest_checkpoint(run) == 2


@pytest.mark.parametrize("found,why", [(99, "newer primerl"), (0, "older primerl"), ("x", "not written by primerl")])
def test_another_format_is_one_line_naming_both(tmp_path, found, why):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    state_file = checkpoint_path(run, 1) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(state | {"format": found}))
    with pytest.raises(UnreadableFormat, match=f"has format {found!r}, this primerl reads format 1; .*{why}") as err:
        verify_checkpoint(checkpoint_path(run, 1))
    assert "\n" not in str(err.value)
    run_format_path(run).write_text(json.dumps({"format": found}))
    with pytest.raises(UnreadableFormat, match=f"run directory {run} has format {found!r}"):
        check_run_format(run)


def test_what_predates_format_numbers_reads_as_format_1(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    run_format_path(run).unlink()
    state_file = checkpoint_path(run, 1) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["format"]
    state_file.write_text(json.dumps(state))
    check_run_format(run)
    assert verify_checkpoint(checkpoint_path(run, 1))["step"] == 1


if __name__ == "__main__":
    import tempfile

    target = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as cache:
        write_fixture(target, Path(cache))
    print(f"wrote {target}: {sum(p.stat().st_size for p in target.rglob('*') if p.is_file())} bytes")
