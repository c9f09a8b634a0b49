"""`primerl trainer`: the FSDP2 RL trainer (on several ranks: `torchrun --nproc-per-node N -m primerl.entrypoints.trainer`).

For step n = start..max_steps-1: wait for the orchestrator's batch n, train on it (micro-batches dealt round-robin
over ranks; every rank runs the same number of forward/backward passes, padding with zero-weight ones), clip,
AdamW step, checkpoint model and optimizer every `trainer.checkpoint_every` steps (`<run>/checkpoints/step_<n+1>`,
primerl.trainer.checkpoint), then publish the weights as policy version n+1 (`<run>/weights/step_<n+1>`, atomic,
STABLE-marked) for the inference server to load.

A restarted trainer resumes from the newest checkpoint (model, optimizer moments, step) and trains the next batch
the orchestrator wrote; with checkpoint_every=1 (the default) no step is trained twice. With a larger interval the
steps since the last checkpoint are replayed from their stored batches (their first metrics rows are kept). With
`trainer.checkpoint_async` the checkpoint is written while the next step trains, and a kill during that write
replays the steps since the checkpoint before it (AsyncCheckpointer).
"""

import os
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from primerl.app import hydra_app, to_run_config
from primerl.config.schema import RunConfig
from primerl.config.trainer import TrainerConfig
from primerl.config.validate import resolve_dp_shard
from primerl.launch.start import prepare_start_adapter, prepare_start_model
from primerl.metrics import TRAINER, TrainerMetric, append_metrics, read_metrics, serve_live_metrics
from primerl.trainer.checkpoint import Checkpointer, make_checkpointer, restore_sound
from primerl.trainer.dist import DistInfo, close_distributed, init_distributed, main_rank_first
from primerl.trainer.logprobs import TokenScores
from primerl.trainer.loss import PROXIMAL, BatchTotals, policy_loss, with_sequence_tokens
from primerl.trainer.lr_schedule import scheduled_lr
from primerl.trainer.model_load import AdapterSpec
from primerl.trainer.publish import Publisher
from primerl.trainer.trainer import MicroBatch, Trainer
from primerl.trainer.updates import part_totals, rank_micro_batches, split_parts, update_metrics
from primerl.transport.batches import RolloutBatch, read_rollout_batch
from primerl.transport.fingerprint import as_metric
from primerl.transport.run_dir import checkpoint_path, rollout_path
from primerl.transport.weights import versions_to_keep
from primerl.utils.errors import RunError, writing
from primerl.utils.log import get_logger
from primerl.utils.wait import wait_until

log = get_logger("trainer")


def wait_for_batch(run_dir: Path, step: int) -> tuple[Path, float]:
    """The path of batch `step` once the orchestrator has written it, and the seconds waited for it."""
    path, started = rollout_path(run_dir, step), time.perf_counter()
    wait_until(path.exists, f"batch {step} ({path})", note_every_s=60)
    return path, time.perf_counter() - started


def resume(trainer: Trainer, publisher: Publisher, run_dir: Path) -> tuple[int, set[int]]:
    """(the step to train next, the steps that already have a metrics row). Restores the newest checkpoint, the
    metrics row its writer died before appending, and the weights it died before publishing."""
    # a replayed step (checkpoint_every > 1, or back from a damaged checkpoint) keeps its first row
    logged = {row["step"] for row in read_metrics(run_dir, TRAINER)}
    start, state = restore_sound(trainer.restore, run_dir, trainer.info.is_main)
    if start:
        if trainer.info.is_main and start - 1 not in logged:  # the predecessor died between checkpoint and metrics
            append_metrics(run_dir, TRAINER, start - 1, state["metrics"])
        publisher.republish(start)  # killed between checkpoint and publish, or an offer whose sender is gone
    if trainer.info.is_main:
        source = checkpoint_path(run_dir, start) if start else trainer.base
        fresh = " (its weights only: the optimizer starts fresh)" if start and state.get("weights_only") else ""
        log.info(f"starting at step {start} from {source}{fresh} on {trainer.info.world_size} rank(s)")
    return start, logged


def train_on_batch(
    trainer: Trainer, cfg: TrainerConfig, batch: RolloutBatch, dp_rank: int, dp: int, constant_tokens: int
) -> dict[str, float]:
    """Collective: the RL updates on `batch`, `trainer.mini_batches` x `trainer.epochs` optimizer steps
    (primerl.trainer.updates). Returns the step's metrics row, less the timings around it: the loss and gradient
    norm averaged over the updates; the mismatch KL, masked fraction, entropy and off-policy weights of the first
    pass. `constant_tokens`: the constant reduction's L (trainer.loss.constant_tokens, else orchestrator.max_tokens)."""
    micro = [with_sequence_tokens(mb) for mb in batch.micro_batches]
    parts = split_parts(micro, cfg.mini_batches)
    totals = [BatchTotals(batch.num_loss_tokens, batch.num_samples, constant_tokens)] if len(parts) == 1 else None
    totals = totals or [part_totals(part, constant_tokens) for part in parts]
    mine = [rank_micro_batches(part, dp_rank, dp) for part in parts]
    if len(parts) * cfg.epochs > 1:  # the policy before the first update scores every micro-batch once
        mine = [[{**mb, PROXIMAL: trainer.score(mb, batch.temperature)} for mb in part] for part in mine]
    trainer.set_lr(scheduled_lr(cfg.lr_schedule, batch.step, cfg.optim.lr, cfg.max_steps))
    results = []
    for _ in range(cfg.epochs):
        for part, part_total in zip(mine, totals, strict=True):

            def loss_fn(scores: TokenScores, mb: MicroBatch, part_total=part_total):
                parts_ = policy_loss(scores, mb, part_total, cfg.loss)
                return parts_.loss, parts_.sums()

            results.append(trainer.step(batch.step, part, loss_fn, batch.temperature))
    return update_metrics(results[: len(parts)], results) | {
        TrainerMetric.MIN_POLICY_VERSION: float(batch.min_policy_version),
        TrainerMetric.LR: trainer.optimizer.param_groups[0]["lr"],
    }


def last_step(cfg: TrainerConfig) -> int:
    """The step the loop ends before: trainer.max_steps, or trainer.stop_at when it comes first."""
    return min(cfg.max_steps, cfg.stop_at or cfg.max_steps)


def save(
    trainer: Trainer,
    publisher: Publisher,
    checkpointer: Checkpointer,
    cfg: TrainerConfig,
    run_dir: Path,
    step: int,
    metrics: dict[str, float],
    keep: int,
) -> dict[str, float]:
    """Collective: checkpoint (every `checkpoint_every` steps and at the end), then publish policy step+1. Returns
    the timings."""
    started = time.perf_counter()
    with writing(f"checkpoint and weights of step {step + 1}", "nothing of it is marked STABLE"):
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == last_step(cfg):
            checkpointer.save(trainer.model, trainer.optimizer, step + 1, metrics)
        published_at = time.perf_counter()
        fingerprint = publisher.publish(step + 1, keep)
    timings = {
        TrainerMetric.CHECKPOINT_S: published_at - started,
        TrainerMetric.PUBLISH_S: time.perf_counter() - published_at,
        TrainerMetric.SAVE_S: time.perf_counter() - started,  # checkpoint + publish
    }
    return timings | ({TrainerMetric.WEIGHTS_FINGERPRINT: as_metric(fingerprint)} if fingerprint else {})


def train(cfg: RunConfig, info: DistInfo) -> None:
    """Collective: the RL step loop (module docstring)."""
    run_dir, tcfg, cp = Path(cfg.output_dir), cfg.trainer, cfg.parallelism.cp
    dp = resolve_dp_shard(cfg, info.world_size)
    if info.is_main:
        serve_live_metrics(cfg.ledger.prometheus, TRAINER, run_dir, cfg.name, cfg.inference.api_key)
    base = main_rank_first(info, lambda: prepare_start_model(cfg))
    adapter = None
    if cfg.model.lora.enabled:  # version 0 is the start adapter, which the servers start with too
        adapter = AdapterSpec(cfg.model.lora, main_rank_first(info, lambda: prepare_start_adapter(cfg)))
    torch.manual_seed(cfg.seed)
    reference = tcfg.loss.needs_reference
    trainer = Trainer.build(
        base, info, tcfg.optim, tcfg, cp, cfg.parallelism.ep, cfg.model.dtype, reference, adapter=adapter
    )
    under_slurm = "SLURM_JOB_ID" in os.environ
    last_batch = rollout_path(run_dir, tcfg.max_steps - 1)
    publisher = Publisher(trainer, run_dir, cfg.weights, last_step(tcfg), under_slurm, last_batch.exists)
    start, logged = resume(trainer, publisher, run_dir)
    with make_checkpointer(run_dir, tcfg.keep_checkpoints, info.is_main, tcfg.checkpoint_async) as checkpointer:
        for step in range(start, last_step(tcfg)):  # the last checkpoint is STABLE before the `with` ends
            path, waited = wait_for_batch(run_dir, step)
            started = time.perf_counter()
            batch = read_rollout_batch(path)
            if batch.step != step:
                raise RunError(f"rollout batch {path} is for step {batch.step}, not {step}: move it aside and rerun")
            read_s = time.perf_counter() - started
            constant_tokens = tcfg.loss.constant_tokens or cfg.orchestrator.max_tokens
            metrics = train_on_batch(trainer, tcfg, batch, info.rank // cp, dp, constant_tokens)
            step_s = time.perf_counter() - started
            # step_s = read + forward + backward + optimizer (with the clip's all-reduce). Host times: on CUDA the
            # split is approximate (kernels run async; .item() syncs), the sum exact.
            metrics |= {
                TrainerMetric.STEP_S: step_s,
                TrainerMetric.WAIT_BATCH_S: waited,
                TrainerMetric.READ_BATCH_S: read_s,
                TrainerMetric.TOKENS_PER_S: sum(mb["input_ids"].numel() for mb in batch.micro_batches) / step_s,
            }
            keep = versions_to_keep(batch.async_level)
            metrics |= save(trainer, publisher, checkpointer, tcfg, run_dir, step, metrics, keep)
            if info.is_main:
                report(run_dir, step, metrics, replayed=step in logged)


def report(run_dir: Path, step: int, metrics: dict[str, float], replayed: bool) -> None:
    if not replayed:
        append_metrics(run_dir, TRAINER, step, metrics)
    log.info(
        f"step {step}{' replayed' if replayed else ''}: loss {metrics[TrainerMetric.LOSS]:+.4f} mismatch_kl "
        f"{metrics[TrainerMetric.MISMATCH_KL]:.2e} grad_norm {metrics[TrainerMetric.GRAD_NORM]:.3f} "
        f"({metrics[TrainerMetric.STEP_S]:.1f}s, waited {metrics[TrainerMetric.WAIT_BATCH_S]:.1f}s)"
    )


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    info = init_distributed(cfg.parallelism.backend)
    try:
        train(cfg, info)
    except BaseException:
        close_distributed(synchronize=False)
        raise
    close_distributed()


if __name__ == "__main__":
    main()
