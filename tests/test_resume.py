"""A resumed run keeps the settings its steps were trained with, unless the user names the ones to change."""

import logging

import pytest

from primerl.app import check
from primerl.launch.resume import check_resume
from primerl.transport.run_dir import rollout_path, run_settings_path
from primerl.utils.errors import ConfigError


def test_a_resume_with_changed_settings_is_refused_unless_allowed(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    base = ["+experiment=reverse_text"]
    check_resume(check(base), run)
    assert run_settings_path(run).exists()
    check_resume(check([*base, "trainer.optim.lr=1"]), run)  # nothing produced yet: the new settings are the run's
    check_resume(check(base), run)
    rollout_path(run, 0).parent.mkdir()
    rollout_path(run, 0).write_bytes(b"a batch")
    check_resume(check([*base, "trainer.max_steps=100", "ledger=none", "env.workers=2"]), run)  # free to change
    with pytest.raises(ConfigError) as refused:
        check_resume(check([*base, "trainer.optim.lr=3e-4", "orchestrator.group_size=4"]), run)
    assert refused.value.key == "orchestrator.group_size"
    assert "orchestrator.group_size 8 -> 4; trainer.optim.lr 0.0001 -> 0.0003" in refused.value.message
    assert "allow_changes=[orchestrator.group_size,trainer.optim.lr]" in refused.value.message
    with pytest.raises(ConfigError, match="env.id"):
        check_resume(check([*base, "env=guess_number"]), run)
    caplog.set_level(logging.WARNING)
    check_resume(check([*base, "trainer.optim.lr=3e-4", "allow_changes=[trainer.optim]"]), run)
    assert "resuming with changed settings (allow_changes): trainer.optim.lr" in caplog.text
    check_resume(check([*base, "trainer.optim.lr=3e-4"]), run)  # the allowed change is the run's setting now


def test_a_setting_added_after_the_run_started_is_its_default_there(tmp_path):
    """A run recorded by an older primerl lacks the settings added since (here `model.lora.*`): it ran with their
    defaults, so resuming it with the defaults is no change, and with another value is one."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    base = ["+experiment=reverse_text"]
    check_resume(check(base), run)
    recorded = json.loads(run_settings_path(run).read_text())
    older = {key: value for key, value in recorded.items() if not key.startswith("model.lora.")}
    assert len(older) < len(recorded)
    run_settings_path(run).write_text(json.dumps(older))
    rollout_path(run, 0).parent.mkdir()
    rollout_path(run, 0).write_bytes(b"a batch")
    check_resume(check(base), run)
    with pytest.raises(ConfigError) as refused:
        check_resume(check([*base, "model.lora.rank=8"]), run)
    assert refused.value.key == "model.lora.rank" and "model.lora.rank 0 -> 8" in refused.value.message
