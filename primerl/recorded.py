"""Overrides read back from a record (`primerl rerun`, `primerl replay`): data, never code.

A record can be written by anyone who can write the tracking store or the run directory (a shared MLflow server has
no authentication), and Hydra turns some overrides into code: `hydra.callbacks.*._target_` is instantiated in the
driver and every child (its block list stops `os.system`, not every callable that runs a command), and an
interpolation such as `${oc.env:SECRET}` copies the environment into the record of the rerun. So an override read
back from a record must be one of primerl's own settings, with a literal value:

- refused always, one line naming it: any `hydra.*` key, a key or value naming `_target_`, `_args_`, `_partial_`,
  `_recursive_` or `_convert_`, an interpolation (`${...}`), a sweep, a `@package`, a key the schema does not have,
  a group option that is not shipped;
- refused unless the user trusts the record (`--trust`): the settings that name code to run (`CODE_KEYS`: shell lines
  of SLURM jobs, sbatch options, vLLM's own flags, a custom loss by import path).
"""

import dataclasses
import os
import pwd
import re
import stat
import sys
import typing
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from primerl.app import CONF_DIR
from primerl.config.schema import RunConfig

INSTANTIATION = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
# settings whose values are code: shell lines, sbatch options, vLLM flags (`--worker-extension-cls`,
# `--middleware` and `--trust-remote-code` import or run code), a loss function by import path
CODE_KEYS = ("launcher.setup", "launcher.sbatch", "inference.extra_args", "trainer.loss.custom")
_OPTION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class UnsafeOverride(ValueError):
    """An override a record may not carry: `override` is it, the message says why."""

    def __init__(self, override: str, why: str):
        super().__init__(f"{override}: {why}")
        self.override, self.why = override, why


def config_groups(config_dirs: tuple[Path, ...] = ()) -> set[str]:
    return {p.name for d in (CONF_DIR, *config_dirs) for p in d.iterdir() if p.is_dir() and p.name != "hydra"}


def _schema_has(key: str) -> bool:
    """Whether `key` (dotted) names a field of RunConfig, or a key inside one of its dict-typed fields."""
    node: object = RunConfig
    for part in key.split("."):
        if not (dataclasses.is_dataclass(node) and isinstance(node, type)):
            return False
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        kind = typing.get_type_hints(node)[part]
        if typing.get_origin(kind) is dict:
            return True  # env.args.*, ledger.tags.*, launcher.sbatch.*: free-form below
        node = kind
    return True


def refusal(override: str, trusted: bool = False, config_dirs: tuple[Path, ...] = ()) -> str | None:
    """Why `override` (one recorded override) may not be used, or None. `config_dirs`: the run's own config
    directories (checked by the caller to be this user's alone), whose group options count as shipped."""
    if "${" in override:
        return "an interpolation: a record holds literal values only"
    if any(word in override for word in INSTANTIATION):
        return "names an object for Hydra to instantiate"
    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException as err:
        return f"not an override ({str(err).splitlines()[0]})"
    key = parsed.key_or_group
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return "a Hydra setting: a record holds primerl's own settings only"
    if parsed.package is not None or parsed.is_sweep_override():
        return "a package or a sweep: a record holds one run's settings"
    if key in config_groups(config_dirs):
        value = parsed.value()
        shipped = isinstance(value, str) and _OPTION.match(value) and _shipped(key, value, config_dirs)
        if parsed.is_delete() or shipped:
            return None
        return f"no shipped option {value!r} of the config group {key}"
    if not _schema_has(key):
        return "not a setting of primerl's schema"
    if not trusted and any(key == code or key.startswith(code + ".") for code in CODE_KEYS):
        return "names code to run (give --trust to run a record you have read and trust)"
    return None


def _shipped(group: str, option: str, config_dirs: tuple[Path, ...] = ()) -> bool:
    return any((d / group / f"{option}.yaml").is_file() for d in (CONF_DIR, *config_dirs))


def check_recorded(overrides: list[str], trusted: bool = False, config_dirs: tuple[Path, ...] = ()) -> list[str]:
    """`overrides` unchanged, or UnsafeOverride naming the first one a record may not carry."""
    for override in overrides:
        why = refusal(override, trusted, config_dirs)
        if why is not None:
            raise UnsafeOverride(override, why)
    return overrides


def foreign_writer(path: Path) -> str | None:
    """Who besides this user could have written `path`: its owner when that is another user, "group or others" when
    it or a directory above it up to the run directory is writable by them; None when only this user could."""
    for node in [path, *list(path.parents)[:2]]:  # the file, .hydra/, the run directory
        info = node.stat()
        if info.st_uid != os.getuid():
            try:
                return pwd.getpwuid(info.st_uid).pw_name
            except KeyError:
                return f"uid {info.st_uid}"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (node.is_dir() and info.st_mode & stat.S_ISVTX):
            return "group or others (it is writable by them)"
    return None


def confirm(command: str, writer: str, what: str) -> bool:
    """Show the command a record would run and ask this user, on a terminal, before running what `writer` wrote."""
    print(f"{what} was written by {writer}, not by you; it would run:\n  {command}", file=sys.stderr)
    if not sys.stdin.isatty():
        return False
    return input("run it? [y/N] ").strip().lower() in ("y", "yes")
