"""`primerl rerun RUN_ID`: the command rebuilt from a run's MLflow record (a real sqlite store): its overrides less
its directory and masked secrets, its seeds, the rerun tag; another commit is refused unless --force; an unknown
run is one line. (A real rerun of a trained run, and `compare --rerun-of`: tests/test_rl_e2e.py.)"""

import shlex
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from primerl.config.cli import check
from primerl.ledger.system_info import system_tags
from tests.conftest import ROOT

RECORDED = [
    "+experiment=reverse_text",
    "trainer.max_steps=3",
    "hydra.run.dir=/somewhere/else",
    "inference.api_key=***",
    "seed=7",
    "+ledger.tags.rerun_of='older'",
]


def _store_with_run(tmp_path, commit: str) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("reverse_text", artifact_location=str(tmp_path / "artifacts"))
    tags = {"git.commit": commit, "git.dirty": "false", "seed": "7", "model.init_seed": "2"}
    run_id = client.create_run(experiment, tags=tags).info.run_id
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(yaml.safe_dump(RECORDED))
    client.log_artifact(run_id, str(overrides), "config")
    return uri, run_id


def _rerun(uri: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "primerl.cli", "rerun", "--tracking-uri", uri, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_command_is_rebuilt_from_the_record(tmp_path):
    here = system_tags()
    uri, run_id = _store_with_run(tmp_path, here["git.commit"])
    force = ["--force"] if here["git.dirty"] != "false" else []  # a checkout with edits in progress
    result = _rerun(uri, run_id, "--dry-run", *force, "trainer.max_steps=2")
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("rerun: ")]
    args = shlex.split(line.removeprefix("rerun: "))[2:]  # after "-m primerl.train"
    assert args == [
        "+experiment=reverse_text",
        "trainer.max_steps=3",
        "seed=7",
        "model.init_seed=2",
        f"+ledger.tags.rerun_of={run_id}",  # shlex takes the quotes off, as a shell would
        "trainer.max_steps=2",
    ]
    cfg = check(args)
    assert cfg.ledger.tags == {"rerun_of": run_id} and cfg.seed == 7 and cfg.trainer.max_steps == 2


@pytest.mark.parametrize("case", ["other commit", "unknown run"])
def test_refusals_are_one_line(tmp_path, case):
    uri, run_id = _store_with_run(tmp_path, "0" * 40)
    if case == "unknown run":
        result, message = _rerun(uri, "f" * 32, "--dry-run"), "no run ffffffff"
    else:
        result, message = _rerun(uri, run_id, "--dry-run"), "the run ran commit 000000000000"
        forced = _rerun(uri, run_id, "--dry-run", "--force")
        assert forced.returncode == 0 and "rerun: warning: the run ran commit" in forced.stderr
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
