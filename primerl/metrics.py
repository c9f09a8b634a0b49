"""Append-only JSONL metrics, one line per step, written by each process and read by the launcher and ledger; and the
names of the metrics that other processes read, defined once (the ledger logs every key, prefixed by its process).

With `ledger.prometheus.port` a process also serves its latest values live (`serve_live_metrics`): every row it
appends from then on, and what it sets itself (the inference process: each vLLM server).
"""

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.config.ledger import PrometheusConfig
from primerl.transport.atomic import append_lines
from primerl.transport.run_dir import metrics_path
from primerl.utils.log import get_logger
from primerl.utils.secrets import METRICS_TOKEN_ENV

if TYPE_CHECKING:
    from primerl.utils.prometheus import LiveMetrics

log = get_logger(__name__)

ORCHESTRATOR, TRAINER = "orchestrator", "trainer"  # the processes that write metrics/<process>.jsonl
EVAL = "eval"  # the orchestrator's online evals (primerl.orchestrator.online_eval): one row per evaluated policy
INFERENCE = "inference"  # serves live metrics only
LIVE_PORT_OFFSET = {ORCHESTRATOR: 0, TRAINER: 1, INFERENCE: 2}  # each process's port: ledger.prometheus.port + this
_live: "tuple[str, LiveMetrics] | None" = None  # this process's live endpoint, with the process it serves


class OrchestratorMetric:
    """Keys of a row of metrics/orchestrator.jsonl: one row per batch cut (step)."""

    REWARD_MEAN = "reward/mean"  # over the batch's samples; reward/<fn> per reward function when there are several
    ROLLOUTS_OK = "rollouts/ok"  # rollouts finished with a usable trace since the previous cut
    ROLLOUTS_FAILED = "rollouts/failed"  # ... failed (env error, timeout, non-finite reward, dead server)
    ROLLOUTS_CANCELLED = "rollouts/cancelled"  # ... in groups cancelled as too stale (or at shutdown)
    OFF_POLICY_MEAN = "off_policy/mean"  # lag of the batch's samples: step - oldest policy version, in versions
    OFF_POLICY_MAX = "off_policy/max"
    OFF_POLICY_DROPPED = "off_policy/dropped"  # samples dropped at the cut as too stale
    ROLLOUTS_FILTERED = "rollouts/filtered"  # in groups orchestrator.filter rejected since the previous cut
    VERSION_SPAN_MAX = "off_policy/span_max"  # most policy versions one sample's rollout spanned (last - first)
    POLICY_VERSION = "policy_version"  # served when the batch was cut
    INFLIGHT = "inflight/rollouts"  # in flight when the batch was cut
    INFLIGHT_LIMIT = "inflight/limit"  # admission=kv_pressure: the sum of the replicas' limits at the cut
    BUFFERED = "queue/buffered_samples"  # left over for the next batches after the cut
    INFERENCE_IDLE = "inference/idle_fraction"  # of the replicas' time since the previous cut, none running (sampled)
    REPLICAS_UP = "inference/replicas_up"  # inference replicas taking rollouts when the batch was cut
    ROLLOUTS_REROUTED = "rollouts/rerouted"  # run again on another replica after theirs went down, since the cut
    ENV_WORKERS_UP = "env/workers_up"  # env worker processes taking rollouts when the batch was cut (env.workers)
    ENV_WORKER_RESTARTS = "env/worker_restarts"  # env workers started again after one was lost, cumulative
    LOOP_LAG_MAX = "loop/lag_max_s"  # event-loop lag: how late a 50 ms timer fired
    LOOP_LAG_MEAN = "loop/lag_mean_s"
    ROLLOUT_MEDIAN_S = "time/rollout_median_s"  # wall time of the rollouts finished since the previous cut
    ROLLOUT_P90_S = "time/rollout_p90_s"
    ROLLOUT_MAX_S = "time/rollout_max_s"
    GENERATE_S = "time/generate_s"  # wall time since the previous cut
    WAIT_POLICY_S = "time/wait_policy_s"  # of which the cut waited for a newer policy (async_level)
    WEIGHT_LOAD_S = "time/weight_load_s"  # of which the inference server was paused for weight loads
    WEIGHT_FANOUT_S = "time/weight_fanout_s"  # from a new version's first load request to every replica serving it
    WRITE_BATCH_S = "time/write_batch_s"  # packing and writing the trainer's batch file (row only, not in the file)
    TOKENS_PER_S = "throughput/completion_tokens_per_s"  # the batch's sampled tokens / GENERATE_S
    # teacher.path: mean over the batch's sampled tokens of student - teacher log-prob (the reverse KL's estimate)
    TEACHER_KL = "teacher/kl"
    TEACHER_S = "time/teacher_s"  # waiting for the teacher's scores since the previous cut, summed over rollouts
    SEQ_LEN_MEAN = "seq_len/mean"


class TrainerMetric:
    """Keys of a row of metrics/trainer.jsonl: one row per trained step."""

    LOSS = "loss"  # the batch's policy loss (primerl.trainer.loss), summed over ranks
    MISMATCH_KL = "mismatch_kl"  # mean over sampled tokens of the k3 estimate of KL(inference policy || trainer's)
    MASKED_FRACTION = "masked_fraction"  # sampled tokens outside the trust region (no loss)
    # ppo_clip, gspo, cispo: sampled tokens whose ratio is outside the clip range, over every update of the batch
    CLIPPED_FRACTION = "clipped_fraction"
    ENTROPY = "entropy"  # of the trainer's policy, mean over sampled positions
    GRAD_NORM = "grad_norm"  # global, before clipping
    LR = "lr"  # the learning rate of the step (trainer.lr_schedule)
    REFERENCE_KL = "reference_kl"  # mean over sampled tokens of k3(trainer, starting policy); with a reference only
    # with an off-policy correction (trainer.loss.off_policy): the IS weight over sampled tokens, and the fraction of
    # them truncated (tis) or masked (mask)
    IS_WEIGHT_MEAN = "off_policy/is_weight_mean"
    IS_WEIGHT_MAX = "off_policy/is_weight_max"
    CORRECTED_FRACTION = "off_policy/corrected_fraction"
    # routing replay: share of sampled tokens predicted from positions routed by the engine's recorded experts
    REPLAYED_FRACTION = "moe/replayed_fraction"
    UPDATE_SKIPPED = "update_skipped"  # share of the batch's updates skipped: loss or gradient norm not finite
    MIN_POLICY_VERSION = "batch/min_policy_version"  # oldest policy that generated any of the batch's tokens
    STEP_S = "time/step_s"  # read the batch + forward + backward + optimizer
    FORWARD_S = "time/forward_s"
    BACKWARD_S = "time/backward_s"
    OPTIMIZER_S = "time/optimizer_s"  # clip, all-reduce and the AdamW step
    WAIT_BATCH_S = "time/wait_batch_s"  # waiting for the orchestrator's batch file
    READ_BATCH_S = "time/read_batch_s"
    CHECKPOINT_S = "time/checkpoint_s"  # on the training thread (with trainer.checkpoint_async: the in-memory copy)
    PUBLISH_S = "time/publish_s"  # writing the policy's weights for the inference servers
    SAVE_S = "time/save_s"  # checkpoint + publish
    TOKENS_PER_S = "throughput/tokens_per_s"  # the batch's tokens (padding included) / STEP_S
    # the published policy's fingerprint (primerl.transport.fingerprint), its first 48 bits as a number; every
    # replica's load must reproduce it (primerl.orchestrator.watcher). Absent for a LoRA adapter
    WEIGHTS_FINGERPRINT = "weights/fingerprint"


def append_metrics(run_dir: str | Path, process: str, step: int, values: dict[str, float]) -> None:
    clean = {k: (v if isinstance(v, int | float) and math.isfinite(v) else None) for k, v in values.items()}
    append_lines(metrics_path(run_dir, process), [json.dumps({"step": step, "time": time.time(), **clean})])
    if _live is not None:  # another process's row written here (the online evals) is prefixed by its name
        prefix = "" if process == _live[0] else f"{process}/"
        _live[1].set({f"{prefix}{key}": value for key, value in {"step": step, **values}.items()})


def serve_live_metrics(
    cfg: PrometheusConfig, process: str, run_dir: str | Path, experiment: str, run_key: str | None
) -> "LiveMetrics | None":
    """This process's live endpoint when `cfg.port` is set (None when off, or with a warning when its port is taken:
    monitoring never stops a run). Labels: `run` (the run directory), `experiment` (the run's name), `process`."""
    global _live
    if not cfg.port:
        return None
    from primerl.utils.prometheus import LiveMetrics  # ~40 ms of imports, for the processes that serve

    port = cfg.port + LIVE_PORT_OFFSET[process]
    labels = {"run": str(Path(run_dir).resolve()), "experiment": experiment, "process": process}
    try:
        endpoint = LiveMetrics(cfg.host, port, os.environ.get(METRICS_TOKEN_ENV) or run_key, labels)
    except OSError as err:
        log.warning(f"live metrics not served: {cfg.host}:{port} (ledger.prometheus.port + {port - cfg.port}): {err}")
        return None
    _live = (process, endpoint)
    log.info(f"live metrics at {endpoint.address} (Prometheus)")
    return endpoint


def append_metrics_once(run_dir: str | Path, process: str, step: int, values: dict[str, float]) -> None:
    """Append `step`'s row unless it is there: how a resumed process restores a row its predecessor died before."""
    if all(row["step"] != step for row in read_metrics(run_dir, process)):
        append_metrics(run_dir, process, step, values)


def read_metrics(run_dir: str | Path, process: str) -> list[dict]:
    path = metrics_path(run_dir, process)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return rows
