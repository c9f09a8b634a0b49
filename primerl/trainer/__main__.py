"""`python -m primerl.trainer` (or `torchrun --nproc-per-node N -m primerl.trainer`): the FSDP2 RL trainer.

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

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM

from primerl.config.cli import hydra_app, to_run_config
from primerl.config.schema import RunConfig
from primerl.config.validate import resolve_dp_shard
from primerl.metrics import append_metrics, read_metrics
from primerl.model.start import initial_model_path
from primerl.trainer.checkpoint import latest_checkpoint, load_checkpoint, make_checkpointer
from primerl.trainer.context_parallel import ContextParallel
from primerl.trainer.dist import (
    DistInfo,
    all_reduce_sum,
    close_distributed,
    data_mesh,
    init_distributed,
    main_rank_first,
    shard_model,
)
from primerl.trainer.expert_parallel import scale_expert_grads
from primerl.trainer.loss import policy_loss
from primerl.trainer.weights import full_state_dict, save_hf_checkpoint
from primerl.transport.atomic import is_stable
from primerl.transport.batches import RolloutBatch, read_rollout_batch
from primerl.transport.run_dir import checkpoint_path, rollout_path, weights_path
from primerl.transport.weights import drop_old_version, versions_to_keep
from primerl.utils.errors import RunError, writing
from primerl.utils.log import get_logger

log = get_logger("trainer")


def wait_for_batch(run_dir: Path, step: int, poll_s: float = 0.2) -> tuple[Path, float]:
    path, started, last_note = rollout_path(run_dir, step), time.perf_counter(), time.monotonic()
    while not path.exists():
        time.sleep(poll_s)
        if time.monotonic() - last_note > 60:
            log.info(f"still waiting for batch {step} ({path})")
            last_note = time.monotonic()
    return path, time.perf_counter() - started


def rank_micro_batches(micro: list[dict[str, torch.Tensor]], dp_rank: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share, padded with loss-free copies so every rank runs ceil(len/dp) passes."""
    per_rank = -(-len(micro) // dp)
    mine = micro[dp_rank::dp]
    while len(mine) < per_rank:
        mine.append({**micro[0], "loss_mask": torch.zeros_like(micro[0]["loss_mask"])})
    return mine


def publish(model: torch.nn.Module, base: str, run_dir: Path, version: int, info: DistInfo, keep: int) -> None:
    """Collective: write policy `version` for the inference server and drop the version it can no longer need (the
    newest `keep` stay: primerl.transport.weights.versions_to_keep)."""
    state = full_state_dict(model)
    if info.is_main:
        save_hf_checkpoint(state, base, weights_path(run_dir, version))
        drop_old_version(run_dir, version, keep)
    dist.barrier()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, cfg: RunConfig,
               info: DistInfo, dp: int, context: ContextParallel | None,
               expert_params: set[torch.nn.Parameter]) -> dict[str, float]:  # fmt: skip
    """Collective: forward/backward over this rank's micro-batches, clip, and the AdamW step unless the loss or the
    gradient norm is not finite (`update_skipped` 1, the weights unchanged). Returns the step's metrics row, less the
    timings of reading the batch and of what follows the update."""
    totals = {"kl": 0.0, "masked": 0.0, "entropy": 0.0, "tokens": 0.0, "loss": 0.0}
    forward_s = backward_s = 0.0
    for micro in rank_micro_batches(batch.micro_batches, info.rank // cfg.parallelism.cp, dp):
        t_forward = time.perf_counter()
        micro = {k: v.to(info.device) for k, v in micro.items()}
        if context:
            with context.inputs(micro) as (input_ids, position_ids):
                logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
            logits, micro = context.loss_inputs(logits, micro)
        else:
            logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False).logits
        parts = policy_loss(logits, micro, batch.num_loss_tokens, cfg.trainer.loss, cfg.orchestrator.temperature)
        t_backward = time.perf_counter()
        forward_s += t_backward - t_forward
        # FSDP2 averages gradients over ranks; the loss is already a share of the global mean
        (parts.loss * info.world_size).backward()
        backward_s += time.perf_counter() - t_backward
        totals["loss"] += parts.loss.item()
        totals["kl"] += parts.mismatch_kl_sum
        totals["masked"] += parts.masked_tokens
        totals["entropy"] += parts.entropy_sum
        totals["tokens"] += parts.tokens
    t_optimizer = time.perf_counter()
    scale_expert_grads(expert_params, info.world_size)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.optim.max_grad_norm))  # global
    totals = {k: all_reduce_sum(v, info.device) for k, v in totals.items()}
    applied = math.isfinite(grad_norm) and math.isfinite(totals["loss"])
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(totals["tokens"], 1.0)
    return {
        "loss": totals["loss"],
        "mismatch_kl": totals["kl"] / tokens,
        "masked_fraction": totals["masked"] / tokens,
        "entropy": totals["entropy"] / tokens,
        "grad_norm": grad_norm,
        "time/forward_s": forward_s,
        "time/backward_s": backward_s,
        "time/optimizer_s": time.perf_counter() - t_optimizer,
        "batch/min_policy_version": float(batch.min_policy_version),
        "update_skipped": float(not applied),
    }


def train(cfg: RunConfig, info: DistInfo) -> None:
    run_dir = Path(cfg.output_dir)
    dp = resolve_dp_shard(cfg, info.world_size)
    base = main_rank_first(info, lambda: initial_model_path(cfg))
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, cfg.model.dtype)).to(info.device)
    model.train()
    cp = cfg.parallelism.cp
    context = ContextParallel(info.rank, info.world_size, cp) if cp > 1 else None
    if context:
        context.enable(model)
    # FSDP2 shards over every rank (dp_shard x cp); a CP group's ranks share each row, so they share micro-batches
    expert_params = shard_model(model, data_mesh(info, info.world_size), cfg.parallelism.ep)
    opt = cfg.trainer.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay, betas=tuple(opt.betas))
    start = latest_checkpoint(run_dir) or 0
    keep = versions_to_keep(cfg.orchestrator.async_level)
    # steps that already have a metrics row: a replayed step (checkpoint_every > 1) keeps its first row
    logged = {row["step"] for row in read_metrics(run_dir, "trainer")}
    if start:
        state = load_checkpoint(model, optimizer, checkpoint_path(run_dir, start))
        if info.is_main and start - 1 not in logged:  # the predecessor died between checkpoint and metrics
            append_metrics(run_dir, "trainer", start - 1, state["metrics"])
        if not is_stable(weights_path(run_dir, start)):  # killed between checkpoint and publish
            publish(model, base, run_dir, start, info, keep)
    if info.is_main:
        source = checkpoint_path(run_dir, start) if start else base
        log.info(f"starting at step {start} from {source} on {info.world_size} rank(s)")
    nonfinite = 0  # steps in a row whose update was skipped
    checkpointer = make_checkpointer(run_dir, cfg.trainer.keep_checkpoints, info.is_main, cfg.trainer.checkpoint_async)
    with checkpointer:  # the last checkpoint is STABLE before the trainer exits
        for step in range(start, cfg.trainer.max_steps):
            path, waited = wait_for_batch(run_dir, step)
            t0 = time.perf_counter()
            batch = read_rollout_batch(path)
            read_s = time.perf_counter() - t0
            metrics = train_step(model, optimizer, batch, cfg, info, dp, context, expert_params)
            step_s = time.perf_counter() - t0
            # step_s = read + forward + backward + optimizer (with the clip's all-reduce). Host times: on CUDA the
            # split is approximate (kernels run async; .item() syncs), the sum exact.
            metrics |= {
                "time/step_s": step_s,
                "time/wait_batch_s": waited,
                "time/read_batch_s": read_s,
                "throughput/tokens_per_s": sum(mb["input_ids"].numel() for mb in batch.micro_batches) / step_s,
            }
            if metrics["update_skipped"]:  # the weights stay as they were; published unchanged, the run goes on
                nonfinite += 1
                log.warning(f"step {step}: loss {metrics['loss']} / grad norm {metrics['grad_norm']} not finite: "
                            f"update skipped ({nonfinite} in a row; trainer.max_nonfinite_steps="
                            f"{cfg.trainer.max_nonfinite_steps})")  # fmt: skip
                if nonfinite >= cfg.trainer.max_nonfinite_steps:
                    raise RunError(f"{nonfinite} steps in a row had a non-finite loss or gradient norm (last: step "
                                   f"{step}); the run stops at its last finite checkpoint")  # fmt: skip
            else:
                nonfinite = 0
            t1 = time.perf_counter()
            with writing(f"checkpoint and weights of step {step + 1}", "nothing of it is marked STABLE"):
                if (step + 1) % cfg.trainer.checkpoint_every == 0 or step + 1 == cfg.trainer.max_steps:
                    checkpointer.save(model, optimizer, step + 1, metrics)
                t2 = time.perf_counter()
                publish(model, base, run_dir, step + 1, info, keep)
            metrics["time/checkpoint_s"] = t2 - t1
            metrics["time/publish_s"] = time.perf_counter() - t2
            metrics["time/save_s"] = time.perf_counter() - t1  # checkpoint + publish
            if info.is_main:
                replayed = step in logged
                if not replayed:
                    append_metrics(run_dir, "trainer", step, metrics)
                log.info(f"step {step}{' replayed' if replayed else ''}: loss {metrics['loss']:+.4f} mismatch_kl "
                         f"{metrics['mismatch_kl']:.2e} grad_norm {metrics['grad_norm']:.3f} ({step_s:.1f}s, waited "
                         f"{waited:.1f}s)")  # fmt: skip


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    info = init_distributed(cfg.parallelism.backend)
    try:
        train(cfg, info)
    finally:
        close_distributed()


if __name__ == "__main__":
    main()
