"""A run's record in Weights & Biases (`ledger.wandb.enabled`, `ledger=wandb` or `ledger=mlflow_wandb`): the same
params (the flattened resolved config), metrics and sampled rollouts as the MLflow record, from the launching process.

- Each process's metrics have their own step axis (`orchestrator/step`, `trainer/step`, `eval/step`, `sft/step`):
  W&B's own step must only grow, and the processes' rows arrive interleaved.
- Sampled rollouts go to the table `rollouts/samples` (step, task, prompt, completion, reward), logged again as it grows.
- `<run>/wandb.json` keeps the W&B run id, so a resumed run continues the same W&B run (`resume="allow"`).
- `ledger.wandb.mode=offline` needs no network: W&B writes the run under `<run>/wandb/`, and `wandb sync` uploads it.
"""

import json
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from primerl.ledger.mlflow_ledger import experiment_name, flatten
from primerl.ledger.run_info import RecordSections
from primerl.transport.atomic import write_json
from primerl.transport.run_dir import wandb_record_path
from primerl.utils.errors import ConfigError
from primerl.utils.secrets import mask_params

SAMPLE_COLUMNS = ("step", "task", "prompt", "completion", "reward")


class WandbTracker:
    def __init__(self, run):
        self.run = run
        self.samples: list[list] = []
        self._axes: set[str] = set()

    @classmethod
    def open(cls, cfg: RecordSections, resolved: DictConfig, run_dir: Path, kind: str = "train") -> "WandbTracker":
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("ledger.wandb.enabled", "W&B is not installed: pip install 'primerl[wandb]'") from err
        w = cfg.ledger.wandb
        record = wandb_record_path(run_dir)
        run_id = json.loads(record.read_text())["run_id"] if record.exists() else uuid.uuid4().hex[:12]
        run = wandb.init(
            project=w.project or experiment_name(cfg),
            entity=w.entity,
            name=f"{cfg.name}-{Path(run_dir).name}",
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=w.mode,
            job_type=kind,
            config=mask_params(flatten(OmegaConf.to_container(resolved, resolve=True))),
            tags=[kind, f"seed-{cfg.seed}"],
        )
        write_json(record, {"run_id": run_id, "project": run.project, "mode": w.mode})
        return cls(run)

    def log_metrics(
        self, step: int, values: dict[str, float | None], prefix: str = "", timestamp_ms: int | None = None
    ) -> None:
        axis = f"{prefix}step"
        if axis not in self._axes:
            self.run.define_metric(axis)
            self.run.define_metric(f"{prefix}*", step_metric=axis)
            self._axes.add(axis)
        self.run.log({axis: step, **{f"{prefix}{k}": v for k, v in values.items() if v is not None}})

    def log_sample(self, row: dict, key: str) -> None:
        """The row joins the table this process logs again as it grows (`key`: W&B keeps no per-row identity)."""
        import wandb

        columns = (row.get("step"), row.get("task", ""), row.get("prompt", ""), row.get("completion", ""))
        self.samples.append([*(str(c) if i else c for i, c in enumerate(columns)), row.get("reward")])
        self.run.log({"rollouts/samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=self.samples)})

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        """MLflow-style key/value tags, as `tag.<key>` entries of the run's config (W&B tags are bare labels)."""
        self.log_params({f"tag.{key}": value for key, value in tags.items()})

    def where(self) -> str:
        """Where to look at this run: its page, or (offline) the command that uploads it."""
        return self.run.url or f"offline in {self.run.dir}; `wandb sync {Path(self.run.dir).parent}` uploads it"

    def finish(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
