"""SFT warm-start: `primerl sft +experiment=reverse_text` (or under torchrun for several ranks).

Trains on demonstrations (the env's own, primerl.envs.demonstrations, or a user's chat dataset `sft.data=FILE.jsonl`)
with loss on assistant tokens only, packed rows, on the same trainer as RL (primerl.trainer.trainer). The loss is
normalised by the number of assistant tokens in the global batch, so 1 rank and N ranks compute the same loss and
gradients. Writes an HF checkpoint to `sft_checkpoint_dir(cfg)` (reused when it already exists; with LoRA,
`model.lora.rank` > 0, by `sft.lora`: an adapter in peft's format that RL continues, the model with it merged, or
every weight trained as without LoRA) and `sft_metrics.json` to the output folder.
"""

import time
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm
from transformers import AutoTokenizer

from primerl.app import hydra_app, to_run_config
from primerl.config.schema import RunConfig
from primerl.config.sft import SftConfig, SftLora
from primerl.config.trainer import OptimConfig
from primerl.config.validate import resolve_dp_shard
from primerl.model.resolve import prepare_base_model
from primerl.sft.cache import sft_checkpoint_dir, sft_trains_lora
from primerl.sft.data import IGNORE, conversation_example, pack
from primerl.sft.source import check_demonstrations, demonstration_batches
from primerl.trainer.dist import DistInfo, all_reduce_sum, close_distributed, init_distributed, main_rank_first
from primerl.trainer.logprobs import TokenScores
from primerl.trainer.lr_schedule import warmup_cosine
from primerl.trainer.model_load import AdapterSpec
from primerl.trainer.trainer import MicroBatch, Trainer
from primerl.transport.atomic import is_stable, write_json
from primerl.transport.run_dir import sft_metrics_path
from primerl.utils.errors import ConfigError
from primerl.utils.log import get_logger

log = get_logger("sft")
STOP_WINDOW = 50  # steps in the mean that `sft.stop_loss` is compared with: ~10k answer tokens at batch 32


def assistant_loss_sum(scores: TokenScores, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over assistant tokens (labels != IGNORE): -log pi of each, from the scores of
    the row's own next tokens (a label that is not IGNORE is the row's token)."""
    return -(scores.logprobs[:, :-1] * (labels[:, 1:] != IGNORE)).sum()


def stop_reached(losses: list[float], stop_loss: float | None) -> bool:
    return (
        stop_loss is not None and len(losses) >= STOP_WINDOW and sum(losses[-STOP_WINDOW:]) / STOP_WINDOW <= stop_loss
    )


def build_trainer(cfg: RunConfig, info: DistInfo) -> Trainer:
    if cfg.sft.batch_size % info.world_size:
        raise ConfigError(
            "sft.batch_size", f"{cfg.sft.batch_size} is not divisible by the world size {info.world_size}"
        )
    resolve_dp_shard(cfg, info.world_size)  # the run's layout must fit; SFT itself is plain FSDP2 over every rank
    base = main_rank_first(info, lambda: prepare_base_model(cfg.model, cfg.cache_dir))
    s = cfg.sft
    optim = OptimConfig(lr=s.lr, weight_decay=s.weight_decay, betas=list(s.betas), max_grad_norm=s.max_grad_norm)
    torch.manual_seed(cfg.seed)
    adapter = AdapterSpec(cfg.model.lora, seed=cfg.seed) if sft_trains_lora(cfg) else None
    return Trainer.build(base, info, optim, cfg.trainer, export_dtype=cfg.model.dtype, adapter=adapter)


def sft_step(trainer: Trainer, tokenizer, conversations: list, s: SftConfig, step: int) -> tuple[float, float]:
    """Collective: one optimizer step on this rank's share of the batch. Returns (global loss, global tokens)."""
    info = trainer.info
    mine = conversations[info.rank :: info.world_size]
    packed = pack(
        [conversation_example(tokenizer, c.messages, c.tools) for c in mine], s.seq_len, tokenizer.pad_token_id
    )
    global_tokens = all_reduce_sum(packed.num_loss_tokens, info.device)

    def loss_fn(scores: TokenScores, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return assistant_loss_sum(scores, micro["labels"]) / global_tokens, {"tokens": micro["input_ids"].numel()}

    trainer.set_lr(warmup_cosine(step, s.lr, s.warmup_steps, s.steps, s.min_lr_ratio))
    micro = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "labels": packed.labels}
    result = trainer.step(step, [micro], loss_fn)
    return result.sums["loss"], result.sums["tokens"]


def train_sft(cfg: RunConfig, info: DistInfo, out_dir: Path) -> list[float]:
    """Collective: SFT on this rank's share of each batch, then the checkpoint at `out_dir` (and every
    `sft.save_every` steps beside it). Returns the global loss per step (the same on every rank)."""
    trainer = build_trainer(cfg, info)
    merged = cfg.sft.lora == SftLora.merged
    tokenizer = AutoTokenizer.from_pretrained(trainer.base)
    losses, tokens_seen, started = [], 0.0, time.perf_counter()
    bar = tqdm(total=cfg.sft.steps, desc="sft", disable=not info.is_main, dynamic_ncols=True)
    for step, conversations in enumerate(demonstration_batches(cfg)):
        loss, tokens = sft_step(trainer, tokenizer, conversations, cfg.sft, step)
        losses.append(loss)
        tokens_seen += tokens
        bar.update()
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_seen / (time.perf_counter() - started):.0f}")
        if stop_reached(losses, cfg.sft.stop_loss):
            bar.total = step + 1  # the bar ends where SFT ends, not at sft.steps
            bar.refresh()
            if info.is_main:
                log.info(
                    f"stopping at step {step + 1}: mean loss of the last {STOP_WINDOW} steps "
                    f"{sum(losses[-STOP_WINDOW:]) / STOP_WINDOW:.4f} <= sft.stop_loss={cfg.sft.stop_loss}"
                )
            break
        if cfg.sft.save_every and (step + 1) % cfg.sft.save_every == 0 and step + 1 < cfg.sft.steps:
            trainer.export(out_dir.with_name(f"{out_dir.name}-step{step + 1}"), merged)
    bar.close()
    trainer.export(out_dir, merged)
    return losses


def record(cfg: RunConfig, dict_cfg: DictConfig, metrics: dict) -> None:
    """`sft_metrics.json` in the output folder (atomically), and the ledger's record of it when the ledger is on."""
    metrics_file = write_json(sft_metrics_path(cfg.output_dir), metrics, indent=2)
    if cfg.ledger.enabled:
        from primerl.ledger.mlflow_ledger import Ledger
        from primerl.ledger.record import record_sft

        ledger = Ledger.open(cfg, dict_cfg, Path(cfg.output_dir).resolve(), kind="sft")
        record_sft(ledger, metrics_file)
        ledger.finish()


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    check_demonstrations(cfg)
    info = init_distributed(cfg.parallelism.backend)
    failed = True  # until every rank is through: then the teardown waits for all of them (close_distributed)
    try:
        out_dir = sft_checkpoint_dir(cfg)
        if is_stable(out_dir):
            if info.is_main:
                log.info(f"reusing warm-start checkpoint {out_dir}")
            failed = False
            return
        started = time.perf_counter()
        losses = train_sft(cfg, info, out_dir)
        wall_s = time.perf_counter() - started
        if info.is_main:
            steps = len(losses)  # fewer than sft.steps when sft.stop_loss stopped it
            record(
                cfg,
                dict_cfg,
                {
                    "losses": losses,
                    "loss_final": losses[-1],
                    "steps": steps,
                    "train_wall_s": wall_s,
                    "world_size": info.world_size,
                    "checkpoint": str(out_dir),
                },
            )
            log.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {wall_s:.0f}s; checkpoint {out_dir}")
            log.info(f"to score it on held-out tasks: primerl eval <these overrides> eval.model={out_dir}")
        failed = False
    finally:
        close_distributed(synchronize=not failed)


if __name__ == "__main__":
    main()
