"""Every path of a run directory, named once.

<run>/
  .hydra/                        composed and resolved config (Hydra)
  logs/<process>.log             one log per process (SLURM: <process>-rank<r>.log for ranks > 0)
  metrics/<process>.jsonl        append-only rows, one per step (primerl.metrics)
  rollouts/step_<n>.safetensors  the batch the trainer trains at step n (transport.batches)
  rollouts/samples.jsonl         a few sample rollouts per step, for people
  weights/step_<v>/              policy v for the inference server, complete iff STABLE (transport.weights)
  pd_kv/<pair>/                  prefill/decode on CPU: each pair's prompt KV from prefill to decode (inference.pd_router)
  checkpoints/step_<n>/          trainer state after n steps (primerl.trainer.checkpoint)
  sft/sft_metrics.json           the SFT warm-start's results, when this run did it
  inference_address.json         SLURM: where the inference job serves (job j > 0: inference_address.<j>.json)
  prefill_address.json           SLURM with prefill/decode: where the prefill job serves (j > 0: ...<j>.json)
  run_settings.json              the settings a resume must keep (primerl.launch.resume)
  start_model.json               the weights the driver decided this start serves and trains (primerl.launch.start)
  format.json                    the directory's format version (primerl.transport.formats)
  ledger.json                    the MLflow run that records this directory
  fork.json                      the run and step a fork started from (primerl.launch.fork)
  wandb.json, wandb/              the W&B run that records this directory (ledger.wandb), and W&B's own files
  ledger_offsets.json            how far the ledger has forwarded each metrics file and the samples
  reward.png                     the reward curve (and online evals), drawn at the end of the run
  driver.lock                    held by the one driver (primerl.train) of this directory
  driver.lease                   SLURM: renewed by the driver while it lives; its jobs stop when it is not (launch.lease)
  eval.json                      primerl.eval's summary (in its own output directory)
"""

import hashlib
import tempfile
from pathlib import Path


def _step(n: int) -> str:
    return f"step_{n:06d}"


def rollout_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"{_step(step)}.safetensors"


def samples_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "rollouts" / "samples.jsonl"


def weights_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def weights_path(run_dir: str | Path, version: int) -> Path:
    return weights_root(run_dir) / _step(version)


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / _step(step)


CHECKPOINT_STATE_FILE = "trainer_state.json"  # in each checkpoint directory: its step, metrics, files and digests


def step_of(path: str | Path) -> int:
    """n of a `step_<n>` name (a rollout file, weight or checkpoint directory)."""
    return int(Path(path).name.split(".")[0].split("_")[1])


def metrics_path(run_dir: str | Path, process: str) -> Path:
    return Path(run_dir) / "metrics" / f"{process}.jsonl"


def log_path(run_dir: str | Path, process: str) -> Path:
    return Path(run_dir) / "logs" / f"{process}.log"


def sft_run_dir(run_dir: str | Path) -> Path:
    """Where a run's own SFT warm-start process writes (its checkpoint goes to the shared cache)."""
    return Path(run_dir) / "sft"


def sft_metrics_path(output_dir: str | Path) -> Path:
    """Written by `primerl.sft` into its output directory (`sft_run_dir(run)` under `primerl.train`)."""
    return Path(output_dir) / "sft_metrics.json"


def inference_address_path(run_dir: str | Path, job: int = 0, role: str = "inference") -> Path:
    """SLURM: where inference job `job` (of launcher.inference_jobs) advertises its node and first port; with
    prefill/decode, role "prefill": where its prefill job advertises its servers' (for the decode job's routers)."""
    return Path(run_dir) / (f"{role}_address.json" if job == 0 else f"{role}_address.{job}.json")


def ledger_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ledger.json"


def fork_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "fork.json"


def run_format_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "format.json"


def run_settings_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "run_settings.json"


def start_model_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "start_model.json"


def wandb_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "wandb.json"


def ledger_offsets_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ledger_offsets.json"


def reward_plot_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "reward.png"


def driver_lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "driver.lock"


def driver_lease_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "driver.lease"


def eval_summary_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "eval.json"


def pd_kv_store(run_dir: str | Path, pair: int) -> Path:
    """Where the CPU prefill server of prefill/decode pair `pair` stores prompts' KV for its decode server
    (primerl.inference.pd_router)."""
    return Path(run_dir) / "pd_kv" / str(pair)


def scratch_prefix(run_dir: str | Path, owner: str) -> str:
    """Name prefix of the private temp dirs of this run's `owner` ("vllm": its servers; "env": its env workers'
    sockets), in the system temp dir (socket paths must stay short), so a rerun can find and remove what a killed
    process left."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return f"primerl-{owner}-{key}-"


def scratch_dirs(run_dir: str | Path) -> list[Path]:
    """Every private temp dir of this run's servers and env workers that exists now."""
    temp = Path(tempfile.gettempdir())
    return sorted(p for owner in ("vllm", "env") for p in temp.glob(scratch_prefix(run_dir, owner) + "*"))
