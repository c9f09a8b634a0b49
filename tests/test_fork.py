"""A fork starts a new run from another run's checkpoint (primerl.launch.fork). The parent is the run directory kept
for the format test (tests/data/run_format_1: batches 0 and 1, the checkpoint of step 1); the trainer here is the
real one, on 1 rank. The whole run path (driver, orchestrator, MLflow tags) is in test_rl_e2e's long test."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from primerl.app import check
from primerl.launch.fork import seed_fork
from primerl.metrics import read_metrics
from primerl.trainer.checkpoint import verify_checkpoint
from primerl.transport.run_dir import checkpoint_path, fork_record_path, rollout_path, run_settings_path
from primerl.utils.errors import ConfigError
from tests.test_formats import FIXTURE, OVERRIDES, _trainer

CHECKPOINT_FILE = "shard-00001-model-00001-of-00001.safetensors"


def _fork_config(parent, fork, cache_dir, *overrides):
    return check([*OVERRIDES, f"fork.run={parent}", f"output_dir={fork}", f"cache_dir={cache_dir}", *overrides])


@pytest.fixture
def parent(tmp_path):
    run = tmp_path / "parent"
    shutil.copytree(FIXTURE, run)
    return run


@pytest.mark.slow
def test_a_fork_goes_on_from_its_parents_checkpoint(parent, cache_dir, tmp_path):
    full, fresh = tmp_path / "fork", tmp_path / "fork_weights_only"
    tags = seed_fork(_fork_config(parent, full, cache_dir, "fork.step=1"), full)
    assert tags == {"fork_step": "1", "fork_run_dir": str(parent)}  # the fixture has no MLflow record
    seed_fork(_fork_config(parent, fresh, cache_dir, "fork.weights_only=true"), fresh)  # the newest: step 1
    # the prefix is linked, not copied; the parent's own files are untouched
    assert rollout_path(full, 0).stat().st_ino == rollout_path(parent, 0).stat().st_ino
    assert not rollout_path(full, 1).exists()
    assert [row["step"] for row in read_metrics(full, "trainer")] == [0]
    assert verify_checkpoint(checkpoint_path(fresh, 1))["weights_only"] is True
    assert "weights_only" not in verify_checkpoint(checkpoint_path(parent, 1))
    assert json.loads(fork_record_path(fresh).read_text())["step"] == 1

    # the parent trains step 1; each fork trains the same batch from the parent's state after step 1
    for run in (full, fresh):
        shutil.copy(rollout_path(parent, 1), rollout_path(run, 1))
    results = {run: _trainer(run, cache_dir, steps=2) for run in (parent, full, fresh)}
    for result in results.values():
        assert result.returncode == 0, result.stderr[-3000:]
    assert f"starting at step 1 from {checkpoint_path(full, 1)} on 1 rank(s)" in results[full].stdout
    assert "(its weights only: the optimizer starts fresh)" in results[fresh].stdout
    assert [row["step"] for row in read_metrics(full, "trainer")] == [0, 1]

    after = {run: load_file(checkpoint_path(run, 2) / CHECKPOINT_FILE) for run in (parent, full, fresh)}
    assert after[full].keys() == after[parent].keys()
    for key, value in after[parent].items():  # weights and optimizer state continue exactly
        assert after[full][key].equal(value), key
    steps = {run: {k: v.item() for k, v in after[run].items() if k.endswith(".step")} for run in (parent, fresh)}
    assert set(steps[parent].values()) == {2.0} and set(steps[fresh].values()) == {1.0}  # AdamW began again
    model = [k for k in after[parent] if k.startswith("model.")]
    assert any(not after[fresh][k].equal(after[parent][k]) for k in model)


def test_a_bad_fork_is_one_line_before_anything_is_written(parent, cache_dir, tmp_path):
    fork = tmp_path / "fork"

    def refused(*overrides, run=parent, into=fork) -> ConfigError:
        with pytest.raises(ConfigError) as err:
            seed_fork(_fork_config(run, into, cache_dir, *overrides), into)
        assert "\n" not in str(err.value)
        return err.value

    assert refused("fork.step=5").key == "fork.step"
    assert "it has: step_000001" in refused("fork.step=5").message
    assert refused(run=tmp_path / "nowhere").key == "fork.run"
    assert refused("model.arch.hidden_size=32").key == "model.arch.hidden_size"
    assert "own directory" in refused(into=parent).message
    rollout_path(parent, 0).rename(tmp_path / "batch_0")
    assert "lacks the rollout batch of step 0" in refused().message
    (tmp_path / "batch_0").rename(rollout_path(parent, 0))
    assert not fork.exists()  # nothing was written

    other = tmp_path / "other"
    other.mkdir()
    run_settings_path(other).write_text("{}")
    assert "holds a run of its own" in refused(into=other).message

    # a fork started once resumes as itself, and refuses another parent or step
    seed_fork(_fork_config(parent, fork, cache_dir), fork)
    assert seed_fork(_fork_config(parent, fork, cache_dir, "fork.step=1"), fork)["fork_step"] == "1"
    assert "was forked from" in refused(run=other).message
