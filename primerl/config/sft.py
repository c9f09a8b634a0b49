"""SFT warm-start settings (a section of the experiment, not a group)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from primerl.utils.bounds import bounded


class SftLora(Enum):
    """What SFT does when the run trains LoRA (`model.lora.rank` > 0)."""

    adapter = "adapter"  # SFT trains the adapter; RL continues that adapter on the base model
    merged = "merged"  # SFT trains an adapter and writes base + adapter merged; RL adds a new adapter on that model
    full = "full"  # SFT trains every weight (the same checkpoint as without LoRA); RL adds a new adapter on it


@dataclass
class SftConfig:
    # Runs only where there are demonstrations: `data`, or the env's own generator (primerl.envs.demonstrations);
    # otherwise RL starts from the base model with a notice.
    enabled: bool = True
    # A chat dataset: JSONL, one {"messages": [{"role": ..., "content": ...}, ...], "tools": [...]} per line
    # (`tools`, assistant `tool_calls` and `tool` messages optional, OpenAI format), or a Hugging Face `datasets`
    # directory (save_to_disk) with a `messages` column; the loss is on every assistant message.
    # None: the env's generated demonstrations (its `demonstrations` hook). The held-out score is primerl.eval's (or
    # the step-0 online eval of `train`); SFT itself reports its loss.
    data: str | None = None
    steps: int = bounded(1500, ge=1)  # optimizer steps; with `stop_loss`, the most
    # Stop once the mean loss of the last STOP_WINDOW (50) steps is at most this: when the start is good enough, however
    # long the task took to appear. Each loss is taken before its batch's update; generated demonstrations are never
    # repeated, so it is a held-out loss (with `sft.data`, only during the first pass over it). None: run every step.
    stop_loss: float | None = bounded(None, gt=0)
    batch_size: int = bounded(32, ge=1)  # sequences per optimizer step, across all ranks
    seq_len: int = bounded(256, ge=2)  # packed row length
    lr: float = bounded(3e-3, gt=0)  # peak: linear warm-up, then cosine decay to `min_lr_ratio` of it
    warmup_steps: int = bounded(50, ge=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # AdamW
    weight_decay: float = bounded(0.0, ge=0)
    max_grad_norm: float = bounded(1.0, gt=0)
    # the options of the env's demonstration generator, e.g. primerl-reverse-text's {uppercase_fraction: 0.5}: half its
    # answers in capitals, a sloppy teacher whose habit RL unlearns (experiments/reverse_text)
    demonstration_args: dict[str, Any] = field(default_factory=dict)
    # also keep the checkpoint every N steps (<checkpoint>-step<N>); 0: only the final one
    save_every: int = bounded(0, ge=0)
    lora: SftLora = SftLora.adapter  # with model.lora only
