"""SFT warm-start: `python -m primerl.sft +experiment=reverse_text` (or under torchrun for several ranks).

Trains on demonstrations (generated for reverse-text and code-lookup, or a user's chat dataset `sft.data=FILE.jsonl`)
with loss on assistant tokens only, packed rows, FSDP2. The loss is normalised by
the number of assistant tokens in the global batch, so 1 rank and N ranks compute the same loss and gradients.
Writes an HF checkpoint to `sft_checkpoint_dir(cfg)` (reused when it already exists) and `sft_metrics.json` to the
output folder.
"""

import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.config.cli import hydra_app, to_run_config
from primerl.config.errors import ConfigError
from primerl.config.schema import RunConfig
from primerl.config.validate import resolve_dp_shard
from primerl.envs.reverse_text import make_texts, prompt_messages, stream_seed
from primerl.model.resolve import base_model_path
from primerl.model.start import GENERATED_DEMONSTRATIONS, sft_checkpoint_dir, sft_data_source
from primerl.sft.data import IGNORE, Conversation, PackedBatch, conversation_example, load_conversations, pack
from primerl.trainer.dist import (
    DistInfo,
    all_reduce_sum,
    close_distributed,
    data_mesh,
    init_distributed,
    main_rank_first,
    shard_model,
)
from primerl.trainer.weights import full_state_dict, save_hf_checkpoint
from primerl.transport.atomic import is_stable
from primerl.transport.run_dir import sft_metrics_path
from primerl.utils.log import get_logger

log = get_logger("sft")


def text_lengths(cfg: RunConfig) -> tuple[int, int]:
    return int(cfg.env.args.get("min_len", 3)), int(cfg.env.args.get("max_len", 8))


def demonstrations(texts: list[str], uppercase_fraction: float, seed: int) -> list[str]:
    """The SFT answer for each text: its reversal, in capitals for a seeded `uppercase_fraction` of them."""
    rng = random.Random(f"{seed}/sft-uppercase")
    return [t[::-1].upper() if rng.random() < uppercase_fraction else t[::-1] for t in texts]


def packed_loss_sum(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Sum of next-token cross-entropy over assistant tokens (labels != IGNORE)."""
    # use_cache=False matters: with a KV cache transformers skips the block-causal mask of packed rows
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch.labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


STOP_WINDOW = 50  # steps in the mean that `sft.stop_loss` is compared with: ~10k answer tokens at batch 32


def stop_reached(losses: list[float], stop_loss: float | None) -> bool:
    return (
        stop_loss is not None and len(losses) >= STOP_WINDOW and sum(losses[-STOP_WINDOW:]) / STOP_WINDOW <= stop_loss
    )


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    s = cfg.sft
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def check_demonstrations(cfg: RunConfig) -> None:
    """A one-line ConfigError when SFT has nothing to learn from: no generator for the env and no `sft.data`, or a
    bad dataset row. Called before any process or rank starts."""
    if cfg.sft.data:
        load_conversations(cfg.sft.data)
    elif sft_data_source(cfg) is None:
        raise ConfigError("sft.data", f"no demonstrations for env.id={cfg.env.id}: give a chat dataset "
                          f"(sft.data=FILE.jsonl); primerl generates them for {', '.join(GENERATED_DEMONSTRATIONS)}")  # fmt: skip


def generated_conversations(cfg: RunConfig, count: int) -> list[Conversation]:
    """`count` demonstrations from the env's own generator (an env in GENERATED_DEMONSTRATIONS)."""
    if cfg.env.id == "code-lookup":
        import code_lookup

        args = {k: cfg.env.args[k] for k in ("salt", "min_len", "max_len") if k in cfg.env.args}
        return [
            Conversation(row["messages"], row["tools"]) for row in code_lookup.demonstrations(count, cfg.seed, **args)
        ]
    texts = make_texts(stream_seed(cfg.seed, "sft"), count, *text_lengths(cfg))
    answers = demonstrations(texts, cfg.sft.uppercase_fraction, cfg.seed)
    return [Conversation(prompt_messages(t) + [{"role": "assistant", "content": a}]) for t, a in zip(texts, answers)]


def demonstration_batches(cfg: RunConfig) -> Iterator[list[Conversation]]:
    """`sft.steps` batches of `sft.batch_size` conversations: from `sft.data` (every pass reshuffled, seeded), or
    generated for the env (`check_demonstrations` first)."""
    size = cfg.sft.batch_size
    if cfg.sft.data:
        data = load_conversations(cfg.sft.data)
        rng, order = random.Random(f"{cfg.seed}/sft-data"), []
        for _ in range(cfg.sft.steps):
            while len(order) < size:
                next_pass = list(range(len(data)))
                rng.shuffle(next_pass)
                order += next_pass
            yield [data[i] for i in order[:size]]
            order = order[size:]
    else:
        conversations = generated_conversations(cfg, cfg.sft.steps * size)
        for step in range(cfg.sft.steps):
            yield conversations[step * size : (step + 1) * size]


def train_sft(cfg: RunConfig, info: DistInfo, out_dir: Path) -> list[float]:
    """Run SFT on this rank's share of each batch; returns the global loss per step (same on every rank)."""
    if cfg.sft.batch_size % info.world_size:
        raise ConfigError(
            "sft.batch_size", f"{cfg.sft.batch_size} is not divisible by the world size {info.world_size}"
        )
    resolve_dp_shard(cfg, info.world_size)  # the run's layout must fit; SFT itself is plain FSDP2 over every rank
    base = main_rank_first(info, lambda: base_model_path(cfg))
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(info.device)
    shard_model(model, data_mesh(info, info.world_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=0.0, betas=(0.9, 0.98))

    batches = demonstration_batches(cfg)
    losses: list[float] = []
    bar = tqdm(range(cfg.sft.steps), desc="sft", disable=not info.is_main, dynamic_ncols=True)
    start = time.perf_counter()
    tokens_seen = 0
    for step, conversations in zip(bar, batches):
        examples = [
            conversation_example(tokenizer, c.messages, c.tools) for c in conversations[info.rank :: info.world_size]
        ]
        batch = pack(examples, cfg.sft.seq_len, tokenizer.pad_token_id)
        batch = PackedBatch(*(t.to(info.device) for t in (batch.input_ids, batch.position_ids, batch.labels)))
        global_tokens = all_reduce_sum(batch.num_loss_tokens, info.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss_sum = packed_loss_sum(model, batch)
        # FSDP2 averages gradients over ranks; scale so the result is d(global sum)/global_tokens.
        (loss_sum * info.world_size / global_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = all_reduce_sum(loss_sum.item(), info.device) / global_tokens
        losses.append(loss)
        tokens_seen += int(all_reduce_sum(batch.input_ids.numel(), info.device))
        if info.is_main:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_seen / (time.perf_counter() - start):.0f}")
        if stop_reached(losses, cfg.sft.stop_loss):
            if info.is_main:
                log.info(f"stopping at step {step + 1}: mean loss of the last {STOP_WINDOW} steps "
                         f"{sum(losses[-STOP_WINDOW:]) / STOP_WINDOW:.4f} <= sft.stop_loss={cfg.sft.stop_loss}")  # fmt: skip
            break
        if cfg.sft.save_every and (step + 1) % cfg.sft.save_every == 0 and step + 1 < cfg.sft.steps:
            state = full_state_dict(model)  # a collective: every rank takes part
            if info.is_main:
                save_hf_checkpoint(state, base, out_dir.with_name(f"{out_dir.name}-step{step + 1}"))
    state = full_state_dict(model)
    if info.is_main:
        save_hf_checkpoint(state, base, out_dir)
    dist.barrier()
    return losses


@hydra_app()
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    check_demonstrations(cfg)
    info = init_distributed(cfg.parallelism.backend)
    try:
        out_dir = sft_checkpoint_dir(cfg)
        if is_stable(out_dir):
            if info.is_main:
                log.info(f"reusing warm-start checkpoint {out_dir}")
            return
        started = time.perf_counter()
        losses = train_sft(cfg, info, out_dir)
        wall_s = time.perf_counter() - started
        if info.is_main:
            metrics = {
                "losses": losses,
                "loss_final": losses[-1],
                "steps": len(losses),  # fewer than sft.steps when sft.stop_loss stopped it
                "train_wall_s": wall_s,
                "world_size": info.world_size,
                "checkpoint": str(out_dir),
            }
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            metrics_file = sft_metrics_path(cfg.output_dir)
            metrics_file.write_text(json.dumps(metrics, indent=2))
            if cfg.ledger.enabled:
                from primerl.ledger.mlflow_ledger import Ledger
                from primerl.ledger.record import record_sft

                ledger = Ledger.open(cfg, dict_cfg, Path(cfg.output_dir).resolve(), kind="sft")
                record_sft(ledger, metrics_file)
                ledger.finish()
            log.info(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {wall_s:.0f}s; checkpoint {out_dir}")
            log.info(f"to score it on held-out tasks: python -m primerl.eval <these overrides> eval.model={out_dir}")
    finally:
        close_distributed()


if __name__ == "__main__":
    main()
