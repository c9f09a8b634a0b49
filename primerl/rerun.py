"""`primerl rerun RUN [--force] [--dry-run] [OVERRIDES...]`: run a recorded run again from its MLflow record.

RUN is the MLflow run id the run's summary printed, a unique prefix of it (8 characters or more), or the run's
directory (its `ledger.json` names the id).

The command is rebuilt from the record: the run's overrides (its `config/overrides.yaml` artifact, else
`<run_dir>/.hydra/overrides.yaml`), its seeds (tags `seed`, `model.init_seed`) and the experiment they name; the
run directory is left out, so the rerun gets a new one, and a masked secret is left out, so the rerun makes its
own key. Run it from the directory the run was launched from: the
rerun is recorded in the same ledger (the recorded `ledger.*` overrides, else the default store). The new MLflow
run is tagged `rerun_of=<RUN_ID>`; `primerl compare --rerun-of RUN_ID` shows the two side
by side with the settings that differ. OVERRIDES given here are added last (an ablation of a recorded run).

The record names the commit it ran (`git.commit`, `git.dirty`): a checkout at another commit, or with uncommitted
changes, may not run what the record ran, and the rerun is refused with one line unless `--force`. What a rerun
reproduces exactly, and what it cannot: docs/training.md, "Rerunning and replaying".

A record is data (primerl.recorded): an override that is not one of primerl's settings with a literal value
is refused with one line naming it, and one whose value is code (SLURM setup lines, vLLM flags, a custom loss) needs
`--trust`. A record another user wrote (its `mlflow.user`, or a store file others own or can write) is shown and
asked about on a terminal, and refused elsewhere, unless `--trust`.

A run made with its own config (`--config-dir`, `--config-path`, `--config-name`, `hydra.searchpath`) is rerun with
the same flags, recorded by the ledger (its directories must still exist; one another user owns or can write counts
as another user's record). Each env's package, version and source digest are recorded too: the rerun warns, one line
each, when an env's installed source differs (its rewards may differ) or is missing.
"""

import argparse
import getpass
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from primerl.compare import default_uri
from primerl.ledger.run_info import env_package
from primerl.ledger.system_info import system_tags
from primerl.recorded import UnsafeOverride, check_recorded, confirm, foreign_writer
from primerl.transport.run_dir import ledger_record_path
from primerl.utils.secrets import MASK

CONFIG_FLAGS = {"primerl.config_path": "--config-path", "primerl.config_dir": "--config-dir"}
CONFIG_FLAGS["primerl.config_name"] = "--config-name"
MIN_PREFIX = 8  # the shortest id prefix accepted: 16^8 ids, so one in a store of thousands of runs is unique
LEFT_OUT = ("output_dir=", "hydra.run.dir=", "hydra.sweep.dir=", "seed=", "model.init_seed=", "ledger.tags.rerun_of=")


class Refused(Exception):
    pass


def recorded_overrides(
    client: MlflowClient, run, trusted: bool = False, config_dirs: tuple[Path, ...] = ()
) -> list[str]:
    """The run's overrides, without its directory, its seeds (added from their tags) and masked secrets; Refused
    when one is not a literal setting of primerl's schema or an option of its config directories (primerl.recorded)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # its bar would be a second line
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = Path(client.download_artifacts(run.info.run_id, "config/overrides.yaml", tmp))
        except (MlflowException, OSError):
            path = Path(run.data.tags.get("primerl.run_dir", "")) / ".hydra" / "overrides.yaml"
        if not path.is_file():
            raise Refused(f"run {run.info.run_id} has no recorded overrides (config/overrides.yaml)")
        overrides = [str(o) for o in yaml.safe_load(path.read_text()) or []]
    kept = [o for o in overrides if not o.lstrip("+~").startswith(LEFT_OUT) and not o.endswith(f"={MASK}")]
    tags = run.data.tags
    seeds = [f"seed={tags.get('seed', '0')}", f"model.init_seed={tags.get('model.init_seed', '0')}"]
    try:
        return check_recorded([*kept, *seeds], trusted, config_dirs)
    except UnsafeOverride as err:
        raise Refused(f"run {run.info.run_id} records an override it may not carry: {err}") from None


def env_changes(run) -> list[str]:
    """A line for each env of the record whose installed source now differs from the recorded digest (its rewards
    may differ) or that is not installed here."""
    changes = []
    for tag, recorded in sorted(run.data.tags.items()):
        if not (tag.startswith("env.") and tag.endswith(".source_sha256")):
            continue
        env_id = tag.removeprefix("env.").removesuffix(".source_sha256")
        now = env_package(env_id)
        if not now:
            changes.append(f"env {env_id} is not installed here")
        elif now["source_sha256"] != recorded:
            was = run.data.tags.get(f"env.{env_id}.package", "?")
            changes.append(
                f"env {env_id}'s source differs from the run's ({was}, sha256 {recorded} -> {now['package']}, "
                f"{now['source_sha256']}): its rewards may differ"
            )
    return changes


def config_flags(run) -> tuple[list[str], tuple[Path, ...]]:
    """The flags that point the rerun at the run's own config (`--config-path`, `--config-dir`, `--config-name`, as
    recorded by the ledger) and its directories; Refused when one is gone."""
    flags, dirs = [], []
    for tag, flag in CONFIG_FLAGS.items():
        value = run.data.tags.get(tag)
        if not value:
            continue
        if flag != "--config-name":
            if not Path(value).is_dir():
                raise Refused(f"the run's config directory {value} ({flag}) is gone")
            dirs.append(Path(value))
        flags += [flag, value]
    return flags, tuple(dirs)


def find_run(client: MlflowClient, ref: str, uri: str):
    """The run `ref` names: a run directory, a run id, or a unique prefix of one; Refused otherwise."""
    record = ledger_record_path(ref)
    if record.is_file():
        ref = json.loads(record.read_text())["run_id"]
    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    if len(ref) < MIN_PREFIX or not all(c in "0123456789abcdef" for c in ref):
        raise Refused(
            f"no run {ref} in {uri} (give a run id, {MIN_PREFIX}+ of its first characters, or a run directory)"
        )
    experiments = [e.experiment_id for e in client.search_experiments()]
    matches = [run for page in _pages(client, experiments) for run in page if run.info.run_id.startswith(ref)]
    if len(matches) != 1:
        found = "no run" if not matches else f"{len(matches)} runs"
        raise Refused(f"{found} with an id starting {ref} in {uri}")
    return matches[0]


def _pages(client: MlflowClient, experiments: list[str]):
    token = None
    while experiments:
        page = client.search_runs(experiments, max_results=1000, page_token=token)
        yield page
        token = page.token
        if not token:
            return


def record_writer(run, uri: str, config_dirs: tuple[Path, ...] = ()) -> str | None:
    """Who wrote the record, when that may be another user: its `mlflow.user`, whoever owns or can write the
    store's file (a sqlite store) or one of the run's config directories; None when it is this user's own."""
    user = run.data.tags.get("mlflow.user")
    if user != getpass.getuser():
        return f"user {user}" if user else "an unknown user (no mlflow.user tag)"
    for directory in config_dirs:
        if (writer := foreign_writer(directory)) is not None:
            return writer
    if uri.startswith("sqlite:///"):
        return foreign_writer(Path(uri.removeprefix("sqlite:///")))
    return None


def check_commit(run, force: bool) -> str | None:
    """A warning when this checkout is not the recorded commit, or is dirty; Refused unless `force`."""
    recorded = run.data.tags.get("git.commit", "unknown")
    here = system_tags()
    problems = []
    if here["git.commit"] != recorded:
        problems.append(f"the run ran commit {recorded[:12]}, this checkout is {here['git.commit'][:12]}")
    if here["git.dirty"] != "false":
        problems.append("this checkout has uncommitted changes")
    if run.data.tags.get("git.dirty") == "true":
        problems.append("the run itself ran with uncommitted changes, which the record does not hold")
    if not problems:
        return None
    message = "; ".join(problems)
    if not force:
        raise Refused(f"{message}: the rerun may not run what the record ran (--force to go on)")
    return message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="primerl rerun", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_id", help="the run to repeat: its MLflow run id, a unique prefix of it, or its directory")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else the sqlite store in --store-dir")
    parser.add_argument("--store-dir", default="outputs", help="the embedded store's directory (default: outputs)")
    parser.add_argument("--force", action="store_true", help="go on at another commit or with uncommitted changes")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument(
        "--trust", action="store_true", help="run a record another user wrote, and settings that name code, unasked"
    )
    args, extra = parser.parse_known_args(argv)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri(args.store_dir)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        print(f"rerun: no ledger at {uri} (--store-dir or --tracking-uri)", file=sys.stderr)
        return 2  # an MlflowClient would create an empty store there
    client = MlflowClient(uri)
    try:
        run = find_run(client, args.run_id, uri)
        run_id = run.info.run_id
        flags, config_dirs = config_flags(run)
        recorded = recorded_overrides(client, run, args.trust, config_dirs)
        overrides = [*recorded, f"+ledger.tags.rerun_of='{run_id}'", *extra]
        warning = check_commit(run, args.force)
    except Refused as err:
        print(f"rerun: {err}", file=sys.stderr)
        return 2
    for line in ([warning] if warning else []) + env_changes(run):
        print(f"rerun: warning: {line}", file=sys.stderr)
    cmd = [sys.executable, "-m", "primerl.train", *flags, *overrides]
    shown = shlex.join(["primerl", "train", *flags, *overrides])
    print(f"rerun: {shown}", flush=True)
    if args.dry_run:
        return 0
    writer = None if args.trust else record_writer(run, uri, config_dirs)
    if writer is not None and not confirm(shown, writer, f"run {run_id}'s record"):
        print(f"rerun: not run: the record was written by {writer} (read it, then --trust)", file=sys.stderr)
        return 2
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
