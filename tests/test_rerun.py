"""`primerl rerun RUN_ID`: the command rebuilt from a run's MLflow record (a real sqlite store): its overrides less
its directory and masked secrets, its seeds, the rerun tag; another commit is refused unless --force; an unknown
run is one line. A record is data: planted overrides that Hydra would turn into code, or into a copy of the
environment, are refused by rerun and by replay before anything runs, and another user's record is not run unasked.
(The rerun of a trained run: tests/test_rl_e2e.py; `compare --rerun-of`: tests/test_ledger.py.)"""

import getpass
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from primerl.app import check
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


def _store_with_run(tmp_path, commit: str, recorded=RECORDED, user: str | None = None, **tags) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("reverse_text", artifact_location=str(tmp_path / "artifacts"))
    tags = {"git.commit": commit, "git.dirty": "false", "seed": "7", "model.init_seed": "2", **tags}
    tags["mlflow.user"] = user or getpass.getuser()
    run_id = client.create_run(experiment, tags=tags).info.run_id
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text(yaml.safe_dump(list(recorded)))
    client.log_artifact(run_id, str(overrides), "config")
    return uri, run_id


def _rerun(uri: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "primerl.cli", "rerun", "--tracking-uri", uri, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_command_is_rebuilt_from_the_record(tmp_path):
    here = system_tags()
    uri, run_id = _store_with_run(tmp_path, here["git.commit"])
    force = ["--force"] if here["git.dirty"] != "false" else []  # a checkout with edits in progress
    run_dir = tmp_path / "run"  # the run's directory names its MLflow run (ledger.json)
    run_dir.mkdir()
    (run_dir / "ledger.json").write_text(json.dumps({"run_id": run_id}))
    shown = set()
    for ref in (run_id, run_id[:8], str(run_dir)):  # the id, the prefix, or the run directory
        result = _rerun(uri, ref, "--dry-run", *force, "trainer.max_steps=2")
        assert result.returncode == 0, result.stderr
        shown.add(result.stdout)
    assert len(shown) == 1
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("rerun: ")]
    args = shlex.split(line.removeprefix("rerun: "))[2:]  # after "-m primerl.train"
    assert args == [
        "+experiment=reverse_text",
        "trainer.max_steps=3",
        "seed=7",
        "model.init_seed=2",
        f"+ledger.tags.rerun_of='{run_id}'",  # quoted for Hydra: the id stays a string
        "trainer.max_steps=2",
    ]
    cfg = check(args)
    assert cfg.ledger.tags == {"rerun_of": run_id} and cfg.seed == 7 and cfg.trainer.max_steps == 2


def test_a_run_of_the_users_own_config_dir_reruns_with_it_and_a_changed_env_is_named(tmp_path):
    """Tags the ledger records (primerl.config_dir, env.<id>.source_sha256) bring the user's config directory back as
    --config-dir, its options accepted; a changed or missing env is a warning line; a config directory others can
    write is another user's record; a directory that is gone is one line."""
    from primerl.app import ConfigSource
    from primerl.ledger.run_info import env_package

    own = tmp_path / "conf"
    (own / "experiment").mkdir(parents=True)
    (own / "experiment" / "my_exp.yaml").write_text("# @package _global_\ndefaults:\n  - reverse_text\nname: mine\n")
    here = system_tags()
    force = ["--force"] if here["git.dirty"] != "false" else []
    digest = env_package("primerl-reverse-text")["source_sha256"]
    tags = {
        "primerl.config_dir": str(own),
        "env.primerl-reverse-text.source_sha256": digest,
        "env.gone-env.source_sha256": "0" * 16,
    }
    recorded = ["+experiment=my_exp", "trainer.max_steps=3"]
    uri, run_id = _store_with_run(tmp_path, here["git.commit"], recorded, **tags)
    result = _rerun(uri, run_id, "--dry-run", *force)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("rerun: ")]
    args = shlex.split(line.removeprefix("rerun: "))[2:]
    assert args[:3] == ["--config-dir", str(own), "+experiment=my_exp"]
    assert check(args[2:], source=ConfigSource(added_dir=own)).name == "mine"
    assert "rerun: warning: env gone-env is not installed here" in result.stderr
    assert "primerl-reverse-text" not in result.stderr  # unchanged

    os.chmod(own, 0o775)  # a directory its group can write: not this user's alone
    shared = _rerun(uri, run_id, *force)
    assert shared.returncode == 2 and "written by group or others" in shared.stderr, shared.stderr
    os.chmod(own, 0o755)
    (own / "experiment" / "my_exp.yaml").rename(own / "moved.yaml")
    missing = _rerun(uri, run_id, "--dry-run", *force)
    assert missing.returncode == 2 and "no shipped option 'my_exp'" in missing.stderr, missing.stderr
    shutil.rmtree(own)
    gone = _rerun(uri, run_id, "--dry-run", *force)
    assert gone.returncode == 2 and f"the run's config directory {own} (--config-dir) is gone" in gone.stderr


@pytest.mark.parametrize("case", ["other commit", "unknown run", "short prefix", "no store"])
def test_refusals_are_one_line(tmp_path, case):
    uri, run_id = _store_with_run(tmp_path, "0" * 40)
    if case == "unknown run":
        result, message = _rerun(uri, "f" * 32, "--dry-run"), "no run with an id starting ffffffff"
    elif case == "short prefix":
        result, message = _rerun(uri, run_id[:4], "--dry-run"), "8+ of its first characters"
    elif case == "no store":  # a mistyped store is reported, not created empty
        absent = tmp_path / "elsewhere" / "mlflow.db"
        result, message = _rerun(f"sqlite:///{absent}", run_id, "--dry-run"), "no ledger at"
        assert not absent.exists()
    else:
        result, message = _rerun(uri, run_id, "--dry-run"), "the run ran commit 000000000000"
        forced = _rerun(uri, run_id, "--dry-run", "--force")
        assert forced.returncode == 0 and "rerun: warning: the run ran commit" in forced.stderr
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# what an attacker with write access to a shared store or run directory plants: a Hydra callback that runs a shell
# command in the driver (Hydra's block list stops os.system, not this), and a tag that copies a secret into the record
PLANTED = "+hydra.callbacks.x._target_=uuid._get_command_stdout"


def _planted(marker) -> list[str]:
    return [PLANTED, f"+hydra.callbacks.x._args_=[[sh,-c,'touch {marker}']]", "+experiment=reverse_text"]


@pytest.mark.parametrize(
    "override, why",
    [
        (PLANTED, "names an object for Hydra to instantiate"),
        ("+ledger.tags.x=${oc.env:HOME}", "an interpolation"),
        ("hydra.run.dir=/tmp/x", "a Hydra setting"),
        ("trainer.no_such=1", "not a setting of primerl's schema"),
        ("env=../../../tmp/x", "no shipped option"),
        ("trainer.optim.lr=1e-4,1e-3", "a package or a sweep"),
        ("launcher.setup=[touch /tmp/x]", "names code to run"),
        ("+inference.extra_args=[--trust-remote-code]", "names code to run"),
    ],
)
def test_a_record_holds_literal_settings_of_the_schema_only(override, why):
    from primerl.recorded import refusal

    assert why in (refusal(override) or "")
    assert refusal("+experiment=reverse_text") is None and refusal("env.args.seed=3") is None
    assert refusal("launcher.setup=[module load cuda]", trusted=True) is None  # the user read it and trusts it


def test_planted_code_in_a_record_is_refused_by_rerun_and_replay_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    here = system_tags()
    uri, run_id = _store_with_run(tmp_path, here["git.commit"], _planted(marker))
    result = _rerun(uri, run_id, "--force")
    assert result.returncode == 2, result.stderr
    assert f"records an override it may not carry: {PLANTED}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(_planted(marker)))
    replay = [sys.executable, "-m", "primerl.cli", "replay", str(run), "--steps", "0:1"]
    result = subprocess.run(replay, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"may not carry: {PLANTED}" in result.stderr, result.stderr
    assert not marker.exists()


def test_a_record_another_user_could_write_is_shown_and_not_run_unasked(tmp_path):
    here = system_tags()
    force = ["--force"] if here["git.dirty"] != "false" else []
    uri, run_id = _store_with_run(tmp_path, here["git.commit"], user="mallory")
    # trainer.max_steps=0 makes the rerun's own command a config error: it ends at once, having run
    result = _rerun(uri, run_id, *force, "trainer.max_steps=0")
    assert result.returncode == 2 and "was written by user mallory" in result.stderr, result.stderr
    assert "it would run:\n  primerl train +experiment=reverse_text" in result.stderr
    assert "config error" not in result.stderr  # not run
    trusted = _rerun(uri, run_id, *force, "--trust", "trainer.max_steps=0")
    assert "primerl: config error: trainer.max_steps" in trusted.stderr  # run, as its user asked

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+experiment=reverse_text"]))
    os.chmod(run / ".hydra" / "overrides.yaml", 0o666)  # anyone may have changed it
    replay = [sys.executable, "-m", "primerl.cli", "replay", str(run)]
    result = subprocess.run(replay, cwd=ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "was written by group or others" in result.stderr, result.stderr
