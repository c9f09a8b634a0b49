"""Hydra entry points with one-line config errors.

Every process (`primerl.train`, `.sft`, `.inference`, `.orchestrator`, `.trainer`) is a Hydra app made by `hydra_app`.
Before Hydra runs, the command line is composed once here ("preflight"), from where its `--config-dir`,
`--config-path` and `--config-name` say: a bad key, type, value or group option, or a failed cross-field check,
prints one line `primerl: config error: KEY: why` and exits 2, with no traceback. Sweep overrides (`-m a=1,2`) are
checked value by value. Inside the app the config it got is validated again (a sweep's job, a SLURM job), and a
ConfigError raised later (checks that need the world size, the device or the environment) is reported the same way.
"""

import dataclasses
import functools
import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from primerl.config.schema import RunConfig, register_schema
from primerl.config.validate import validate
from primerl.utils.errors import ConfigError, RunError
from primerl.utils.log import configure_logging, get_logger

CONF_DIR = Path(__file__).resolve().parent / "conf"  # package data: installed with primerl
EXIT_CONFIG_ERROR = 2
# Flags after which Hydra prints help or information and exits.
_SKIP_PREFLIGHT = {"--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc"}
# Flags that change where the config comes from: the preflight composes from there too.
_CONFIG_FLAGS = {
    "--config-dir": "dir",
    "-cd": "dir",
    "--config-path": "path",
    "-cp": "path",
    "--config-name": "name",
    "-cn": "name",
}

# Hydra flags followed by a value that is not an override (e.g. `--cfg job`).
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--experimental-rerun", *_CONFIG_FLAGS}

register_schema()


def overrides_in(argv: list[str]) -> list[str]:
    """The config overrides of a Hydra command line: every argument that is neither a flag nor a flag's value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _VALUE_FLAGS:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """Where a command line's config comes from: the primary config's directory and name, and a directory added to
    the search path (`--config-dir`), as Hydra takes them."""

    primary_dir: Path = CONF_DIR
    name: str = "config"
    added_dir: Path | None = None

    def initial(self) -> tuple[Path, list[str]]:
        """The directory to compose from (the one holding the primary config) and the override that puts the other
        one on the search path, as Hydra's own search path holds both."""
        dirs = [self.primary_dir, *([self.added_dir] if self.added_dir else [])]
        primary = next((d for d in dirs if (d / f"{self.name}.yaml").is_file()), self.primary_dir)
        others = [f"file://{d}" for d in dirs if d != primary]
        return primary, [f"hydra.searchpath=[{','.join(others)}]"] if others else []


def config_source(argv: list[str], config_name: str = "config") -> ConfigSource:
    """The ConfigSource of a command line's `--config-dir`, `--config-path` and `--config-name` (a relative
    --config-path is relative to this module's directory, as Hydra resolves it for the app declared here)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in _CONFIG_FLAGS:
            found[_CONFIG_FLAGS[flag]] = value if value else (argv[i + 1] if i + 1 < len(argv) else "")
    primary = Path(found["path"]) if "path" in found else CONF_DIR
    if not primary.is_absolute():
        primary = (Path(__file__).parent / primary).resolve()
    added = Path(found["dir"]).resolve() if "dir" in found else None
    return ConfigSource(primary, found.get("name", config_name), added)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed, fully resolved config object."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _allowed_keys(exc: OmegaConfBaseException) -> str:
    object_type = getattr(exc, "object_type", None)
    if object_type is not None and dataclasses.is_dataclass(object_type):
        return "; allowed keys: " + ", ".join(f.name for f in dataclasses.fields(object_type))
    return ""


def format_config_error(exc: BaseException) -> str:
    """One line naming the key and why it is wrong."""
    if isinstance(exc, ConfigError):
        return f"{exc.key}: {exc.message}"
    chain, cur = [], exc
    while cur is not None:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            first = str(err.msg if hasattr(err, "msg") else err).splitlines()[0]
            if "not in" in first or "not found" in first or "Key '" in first:
                first += _allowed_keys(err)
            return f"{err.full_key}: {first}"
    text = str(exc)
    missing = re.search(r"Could not find '([^']+)'", text)
    if missing:
        group, _, option = missing.group(1).rpartition("/")
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return f"{group}={option}: no such option; available: {', '.join(options) or '(none)'}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(lines[:3]) if lines else type(exc).__name__


def compose(overrides: list[str], config_name: str = "config", source: ConfigSource | None = None) -> DictConfig:
    """Compose the config outside a Hydra app (tests, preflight). `output_dir` is left unresolved."""
    source = source or ConfigSource(name=config_name)
    primary, search = source.initial()
    GlobalHydra.instance().clear()
    with hydra.initialize_config_dir(config_dir=str(primary), version_base="1.3"):
        return hydra.compose(config_name=source.name, overrides=[*search, *overrides])


def check(overrides: list[str], config_name: str = "config", source: ConfigSource | None = None) -> RunConfig:
    """Compose, type-check and cross-validate; raises on the first problem."""
    cfg = compose(overrides, config_name, source)
    if OmegaConf.is_interpolation(cfg, "output_dir"):
        cfg.output_dir = "."  # ${hydra:...} only resolves inside a running app
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(missing[0], "is required and has no value (set it on the command line: KEY=VALUE)")
    run = to_run_config(cfg)
    validate(run)
    return run


def _expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """The override lists to check for a multirun: the first point, then each further swept value once."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for text, ov in zip(overrides, parsed):
        if ov.key_or_group.startswith("hydra"):
            choices.append([])
        elif ov.is_sweep_override():
            try:
                values = list(ov.sweep_string_iterator())
            except Exception:  # interval() and other optimizer-only sweeps have no finite values
                values = []
            choices.append([f"{ov.get_key_element()}={v}" for v in values])
        else:
            choices.append([text])
    base = [c[0] for c in choices if c]
    points = [base]
    for i, c in enumerate(choices):
        for value in c[1:]:
            point = [c2[0] if j != i else value for j, c2 in enumerate(choices) if c2]
            points.append(point)
    return points


def preflight(argv: list[str], config_name: str = "config") -> None:
    """Exit 2 with one line on the first config error in this command line (composed from where its flags say)."""
    if any(a.split("=")[0] in _SKIP_PREFLIGHT for a in argv):
        return
    overrides = overrides_in(argv)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    try:
        source = config_source(argv, config_name)
        points = _expand_sweeps(overrides) if multirun else [overrides]
        for point in itertools.islice(points, 64):
            check(point, source=source)
    except Exception as exc:  # noqa: BLE001 - every failure here is a config error to report in one line
        print(f"primerl: config error: {format_config_error(exc)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    finally:
        GlobalHydra.instance().clear()


def _process_name(task: Callable) -> str:
    """`trainer` for primerl.entrypoints.trainer (also run as `-m primerl.entrypoints.trainer`, where __module__ is
    `__main__`), `train` for primerl.train."""
    module = task.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else "primerl"
    return module.removeprefix("primerl.entrypoints.").removeprefix("primerl.").split(".")[0]


def help_header(task: Callable) -> str:
    """The override that opens `primerl COMMAND --help` with what the command does: its module's docstring."""
    module = sys.modules.get(task.__module__)
    doc = (getattr(module, "__doc__", None) or "").strip().split("\n\n")[0]
    if doc.startswith("`") and "`: " in doc:  # "`primerl eval`: score ..." -> "score ..."
        doc = doc.split("`: ", 1)[1]
    name = _process_name(task)
    text = f"primerl {name}: {doc}\n" if doc else f"primerl {name}\n"
    return "hydra.help.header=" + "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def hydra_app(config_name: str = "config") -> Callable[[Callable[[DictConfig], object]], Callable[[], object]]:
    """Decorator: `@hydra_app()` over `def main(cfg: DictConfig)` gives a checked Hydra entry point."""

    def wrap(task: Callable[[DictConfig], object]) -> Callable[[], object]:
        @functools.wraps(task)  # Hydra unwraps __wrapped__ to name the job after `task`
        def checked(cfg: DictConfig) -> object:
            configure_logging()
            try:
                # again here, on the config the app got: a sweep's job, a SLURM job, a config the preflight could
                # not reach all fail in the same one line, before anything starts
                validate(to_run_config(cfg))
                return task(cfg)
            except ConfigError as err:  # found at run time (world size, devices, env loading): same one line
                print(f"primerl: config error: {err}", file=sys.stderr)
                sys.exit(EXIT_CONFIG_ERROR)
            except RunError as err:
                get_logger(_process_name(task)).error(str(err))
                sys.exit(1)

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(checked)

        @functools.wraps(task)
        def entry() -> object:
            if any(a in ("--help", "-h") for a in sys.argv[1:]):
                sys.argv.append(help_header(task))
            preflight(sys.argv[1:], config_name)
            return hydra_main()

        return entry

    return wrap
