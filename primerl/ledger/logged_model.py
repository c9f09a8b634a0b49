"""The run's final policy as an MLflow 3 logged model, `policy-v<N>`, linked as the run's output.

- Full weights: the published directory saved in MLflow's transformers flavor (`MLmodel` + the HF files), so
  `mlflow.transformers.load_model("models:/<model id>")` gives a text-generation pipeline and "Register model" in the
  UI registers something loadable. A LoRA policy: its PEFT adapter files (`adapter_config.json`, the safetensors),
  loadable with `peft.PeftModel.from_pretrained(base, dir)` after `mlflow.artifacts.download_artifacts`.
- Its weights are copied into the store only up to `ledger.log_model_max_mb`; a larger policy, or `ledger.log_model`
  off, is logged without files: its params and a tag with the weights directory. Saving in the flavor loads the
  model once in the launching process (~10 s for the tiny model here, most of it imports).
- The online evals of that policy version are logged against the model (`eval/<env id>/reward_mean`, ...), so the
  model page shows its scores. Once per version, however often the run is resumed.
"""

import tempfile
import time
from pathlib import Path

from primerl.config.ledger import LedgerConfig
from primerl.config.model import ModelConfig
from primerl.ledger.mlflow_ledger import Ledger
from primerl.metrics import EVAL, read_metrics
from primerl.utils.log import get_logger

log = get_logger(__name__)
MB = 1 << 20


def record_policy(
    ledger: Ledger, settings: LedgerConfig, model: ModelConfig, run_dir: Path, weights_dir: Path, version: int
) -> str | None:
    """Log `weights_dir` (policy `version` of the run in `run_dir`) as the run's logged model; its id, or None when
    this version was logged before."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    client, name = ledger.client, f"policy-v{version}"
    if ledger.logged_model(name) is not None:
        return None
    adapter = (weights_dir / "adapter_config.json").exists()
    size = sum(f.stat().st_size for f in weights_dir.iterdir() if f.is_file())
    copied = settings.log_model and size <= settings.log_model_max_mb * MB
    tags = {"primerl.weights_dir": str(weights_dir), "primerl.policy_version": str(version)}
    tags["primerl.format"] = "peft-adapter" if adapter else "transformers"
    params = {"policy_version": str(version), "size_mb": f"{size / MB:.1f}", "files_in_store": str(copied)}
    params["base_model"] = model.hub_id or model.path or model.source.value
    logged = client.create_logged_model(
        ledger.experiment_id, name, ledger.run_id, tags, params, model_type="primerl-policy"
    )
    try:
        if copied:
            _log_files(client, logged.model_id, weights_dir, adapter)
        elif settings.log_model:
            log.info(
                f"{name} is {size / MB:.0f} MB, over ledger.log_model_max_mb={settings.log_model_max_mb}: "
                f"logged without its files (they stay in {weights_dir})"
            )
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.log_outputs(ledger.run_id, [LoggedModelOutput(logged.model_id, step=version)])
    _log_evals(ledger, run_dir, version, logged.model_id)
    return logged.model_id


def _log_files(client, model_id: str, weights_dir: Path, adapter: bool) -> None:
    """The policy's files under the logged model: an adapter as it is, full weights in the transformers flavor."""
    if adapter:
        client.log_model_artifacts(model_id, str(weights_dir))
        return
    import mlflow.transformers
    import torch
    import transformers

    requirements = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "model"
        # the requirements are given: MLflow's own inference imports torchvision, which CPU installs leave out
        mlflow.transformers.save_model(
            transformers_model=str(weights_dir), path=str(saved), task="text-generation", pip_requirements=requirements
        )
        client.log_model_artifacts(model_id, str(saved))


def _log_evals(ledger: Ledger, run_dir: Path, version: int, model_id: str) -> None:
    """The online eval of policy `version`, when the run made one, as the model's metrics (the run's own copy of
    them is logged by the follower, primerl.ledger.follower)."""
    from mlflow.entities import Metric

    rows = [row for row in read_metrics(run_dir, EVAL) if row.get("step") == version]
    if not rows:
        return
    row = dict(rows[-1])
    stamp = int(float(row.pop("time", time.time())) * 1000)
    metrics = [
        Metric(f"{EVAL}/{key}", float(value), stamp, version, model_id=model_id)
        for key, value in row.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    ]
    ledger.client.log_batch(ledger.run_id, metrics=metrics)
