"""What a run's record says about it beside its config: its name in the UI, its description, MLflow's standard tags
(Source, Created by, Git commit, Description) and where its config came from."""

import functools
import getpass
import hashlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from typing import Protocol

from primerl.config.env import EnvConfig, MixtureEntry
from primerl.config.eval import EvalConfig
from primerl.config.launcher import LauncherConfig
from primerl.config.ledger import LedgerConfig
from primerl.config.model import ModelConfig
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.sft import SftConfig
from primerl.config.trainer import TrainerConfig
from primerl.utils.secrets import mask_overrides

NAME_OVERRIDES, MAX_NAME_CHARS = 3, 250
NAME_SKIPS = ("hydra.", "ledger.", "launcher.", "output_dir", "inference.api_key", "eval.run", "eval.model")
NAME_SKIPPED_LEAVES = ("seed", "experiment", "name", "port", "host", "cache_dir", "store_dir")
SWEEP = re.compile(r",|^(range|choice|interval|glob|tag)\(")  # a value Hydra sweeps over


class RecordSections(Protocol):
    """The sections of the run's config its record reads beside the resolved config it logs whole (`RunConfig` has
    them, checked by tests/test_layering.py): where and under which names it is recorded (`ledger`, `name`), and what
    its description and tags say: the model, the envs it trains and evaluates on, the seeds, the step counts and batch
    layout, the launcher."""

    name: str
    seed: int
    ledger: LedgerConfig
    model: ModelConfig
    env: EnvConfig
    mixture: list[MixtureEntry]
    eval: EvalConfig
    sft: SftConfig
    trainer: TrainerConfig
    orchestrator: OrchestratorConfig
    launcher: LauncherConfig


def description(cfg: RecordSections, kind: str) -> str:
    """The run's one-paragraph summary in MLflow's Description field."""
    model = cfg.model.hub_id or cfg.model.path or f"{cfg.model.source.value} (built here)"
    if kind == "sft":
        return f"{cfg.name}: SFT warm-start of {model}, {cfg.sft.steps} steps of {cfg.sft.batch_size} on {cfg.env.id}."
    if kind == "eval":
        e = cfg.eval
        return (
            f"{cfg.name}: evaluation of {e.model or f'{e.run} step {e.step}'} on env {cfg.env.id}, "
            f"{e.num_tasks} tasks x {e.samples_per_task} rollouts at temperature {e.temperature}."
        )
    o = cfg.orchestrator
    envs = " + ".join(f"{e.id} ({e.weight:g})" for e in cfg.mixture) if cfg.mixture else cfg.env.id
    return (
        f"{cfg.name}: RL on env {envs} with model {model}, {cfg.trainer.max_steps} steps of "
        f"{o.batch_size} samples ({o.batch_size // o.group_size} groups of {o.group_size}), "
        f"async_level {o.async_level}, launcher {cfg.launcher.name}."
    )


def config_source_tags() -> dict[str, str]:
    """Where this Hydra job's config came from, when not from primerl's own directory alone: the primary config's
    directory (`--config-path`), a directory added to the search path (`--config-dir`, `hydra.searchpath`) and the
    primary config's name; `primerl rerun` passes them back. {} outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hydra_cfg, own = HydraConfig.get(), Path(__file__).resolve().parents[1] / "conf"
    tags = {}
    for source in hydra_cfg.runtime.config_sources:
        if source.schema == "file" and Path(source.path).resolve() != own:
            tags["primerl.config_path" if source.provider == "main" else "primerl.config_dir"] = source.path
    if hydra_cfg.job.config_name not in (None, "config"):
        tags["primerl.config_name"] = hydra_cfg.job.config_name
    return tags


def task_overrides() -> list[str]:
    """The overrides of the Hydra job this process runs (a sweep job's own values), masked; [] outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return mask_overrides(list(HydraConfig.get().overrides.task)) if HydraConfig.initialized() else []


def run_name(cfg: RecordSections, kind: str, overrides: list[str], started: str) -> str:
    """What tells a run from its neighbours in the UI's (truncated) name column, most telling first: the kind (`eval-`,
    `sft-`; none for training), the run's name, up to NAME_OVERRIDES overrides by their last key (the keys this
    process's command sweeps first; no paths, ports or secrets), the seed, and when it started (or its sweep and job
    number)."""
    swept = {o.lstrip("+~").partition("=")[0] for o in sys.argv[1:] if SWEEP.search(o.partition("=")[2])}
    shown = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if value and not key.startswith(NAME_SKIPS) and key.rsplit(".", 1)[-1] not in NAME_SKIPPED_LEAVES:
            shown.append((key not in swept, f"{key.rsplit('.', 1)[-1]}={value}"))
    parts = [cfg.name, *(text for _, text in sorted(shown, key=lambda s: s[0])[:NAME_OVERRIDES])]
    return ("" if kind == "train" else f"{kind}-") + " ".join([*parts, f"seed={cfg.seed}", started])[:MAX_NAME_CHARS]


def standard_tags(cfg: RecordSections, kind: str, git_commit: str) -> dict[str, str]:
    """The tags MLflow's UI shows as Source, Created by, Git commit and Description."""
    return {
        "mlflow.source.name": f"primerl {kind} " + " ".join(mask_overrides(sys.argv[1:]))[:400],
        "mlflow.source.type": "LOCAL",
        "mlflow.source.git.commit": git_commit,
        "mlflow.user": getpass.getuser(),
        "mlflow.note.content": description(cfg, kind),
    }


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """Module -> distributions of everything installed: about 1 s to build, so once per process."""
    return importlib.metadata.packages_distributions()


def env_package(env_id: str) -> dict[str, str]:
    """The installed package of verifiers environment `env_id` (module: the id with `-` as `_`): its distribution and
    version, and a digest of its Python source, the reward definition a rerun must match. {} when not installed."""
    module = env_id.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return {}
    root = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(root.parent)}\n".encode())
        digest.update(path.read_bytes())
    dists = _distributions().get(module, [])
    version = f"{dists[0]}=={importlib.metadata.version(dists[0])}" if dists else "not a distribution"
    return {"package": version, "source_sha256": digest.hexdigest()[:16]}


def env_tags(cfg: RecordSections) -> dict[str, str]:
    """`env.<id>.package` and `env.<id>.source_sha256` for every env the run trains or evaluates on."""
    ids = {cfg.env.id, *(e.id for e in cfg.mixture), *(e.id for e in cfg.eval.envs)}
    return {f"env.{env_id}.{key}": value for env_id in sorted(ids) for key, value in env_package(env_id).items()}
