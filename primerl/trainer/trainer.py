"""The one trainer that RL (`primerl.trainer`) and SFT (`primerl.sft`) both drive: a model sharded with FSDP2 (and CP
or EP when asked), its AdamW optimizer, and one collective training step over this rank's micro-batches.

Invariants of `step`, whatever the loss:
- the loss a loss function returns is this rank's share of the global mean (its normaliser counts the whole global
  batch), so the gradient of 1 rank equals the gradient of N ranks (FSDP2 averages over ranks; `step` multiplies by
  the world size to undo it);
- every rank calls `step` with the same number of micro-batches (at least one) and its loss function returns the
  same keys on every rank: the sums are all-reduced in one collective;
- an update whose loss or global gradient norm is not finite is skipped (the weights and optimizer state stay as
  they were); `max_nonfinite_steps` skipped in a row raise a RunError, and the run stops at its last checkpoint;
- the weights the optimizer updates are fp32 (master weights) whatever the model's stored dtype; with
  `precision="bf16"` FSDP2 computes forward and backward in bf16 and reduces gradients in fp32
  (`MixedPrecisionPolicy`), so an update smaller than bf16's resolution (2^-8 relative) still moves the weights;
- the model's forward scores tokens (primerl.trainer.logprobs.ScoresHead): a loss function gets `TokenScores`,
  never the [B, T, vocab] logits.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from primerl.config.model import LoraConfig
from primerl.config.trainer import OptimConfig, TrainerConfig
from primerl.model.adapter import is_adapter_param, merge_adapters, save_adapter
from primerl.trainer.checkpoint import load_checkpoint
from primerl.trainer.context_parallel import ContextParallel
from primerl.trainer.dist import MAX_SUFFIX, DistInfo, all_reduce_sums
from primerl.trainer.expert_parallel import scale_expert_grads
from primerl.trainer.logprobs import ScoresHead, TokenScores, next_tokens
from primerl.trainer.model_load import AdapterSpec, sharded_model
from primerl.trainer.routing_replay import ReplayRouter, moe_routers, replayed_tokens, replaying
from primerl.trainer.weights import full_state_dict, save_hf_checkpoint
from primerl.transport.batches import ROUTES_FIELD
from primerl.utils.errors import RunError
from primerl.utils.failpoints import failpoint
from primerl.utils.log import get_logger

log = get_logger("trainer")

MicroBatch = dict[str, torch.Tensor]
# (scores, micro-batch) -> (this micro-batch's share of the global loss, sums to report: same keys on every rank)
LossFn = Callable[[TokenScores, MicroBatch], tuple[torch.Tensor, dict[str, float]]]


@dataclass
class StepResult:
    sums: dict[str, float]  # the loss function's sums over every rank's micro-batches, plus "loss"
    grad_norm: float  # global, before clipping
    applied: bool  # False: the loss or the gradient norm was not finite and the update was skipped
    forward_s: float
    backward_s: float
    optimizer_s: float  # clip (with its all-reduce), the sums' all-reduce and the optimizer step


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        info: DistInfo,
        base: str | Path,
        max_grad_norm: float,
        max_nonfinite_steps: int,
        context: ContextParallel | None = None,
        expert_params: set[torch.nn.Parameter] | None = None,
    ):
        self.model, self.optimizer, self.info, self.base = model, optimizer, info, str(base)
        self.max_grad_norm, self.max_nonfinite_steps = max_grad_norm, max_nonfinite_steps
        self.context, self.expert_params = context, expert_params or set()
        self.skipped_in_a_row = 0
        self.export_dtype = torch.float32
        self.reference: torch.nn.Module | None = None
        self.lora: LoraConfig | None = None
        # routing replay: its routers take the batch's routed experts (primerl.trainer.routing_replay)
        self.replays = any(isinstance(router, ReplayRouter) for router in moe_routers(model))
        self._warned_no_routes = False

    @classmethod
    def build(
        cls,
        base: str | Path,
        info: DistInfo,
        optim: OptimConfig,
        compute: TrainerConfig,
        cp: int = 1,
        ep: int = 1,
        export_dtype: str = "float32",
        reference: bool = False,
        adapter: AdapterSpec | None = None,
    ) -> "Trainer":
        """Build the HF model at `base` in fp32 with empty parameters (primerl.trainer.model_load), put a
        `ScoresHead` in place of its lm_head, checkpoint each decoder layer's activations when asked, enable CP over
        groups of `cp` ranks, shard it with FSDP2 over every rank (a CP group's ranks share each row, so they share
        micro-batches; bf16: compute in bf16, reduce in fp32), EP over the same mesh when `ep` > 1; allocate only
        this rank's shards and fill them from `base`; then AdamW. `export_dtype`: the dtype of the weights `export`
        writes (the served model's). `compute`: the trainer's precision, scoring chunk, activation checkpointing and
        non-finite policy (the rest of it is the RL loop's). `reference`: also keep a frozen copy of `base`, sharded
        the same way (no gradients, no optimizer state), whose log-probs each step's scores carry (the reference KL
        of primerl.trainer.loss). `adapter`: LoRA; only the adapters train (AdamW holds state for them alone) and
        `export` writes the adapter alone; the reference is the base model."""
        context = ContextParallel(info.rank, info.world_size, cp) if cp > 1 else None
        model, expert_params = sharded_model(base, info, compute, context, ep, adapter=adapter)
        trained = [param for param in model.parameters() if param.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))
        trainer = cls(
            model, optimizer, info, base, optim.max_grad_norm, compute.max_nonfinite_steps, context, expert_params
        )
        trainer.export_dtype = getattr(torch, export_dtype)
        trainer.lora = adapter.lora if adapter is not None else None
        if reference:
            trainer.reference, _ = sharded_model(base, info, compute, context, ep, frozen=True)
        return trainer

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _scores(self, micro: MicroBatch, temperature: float) -> tuple[TokenScores, MicroBatch]:
        """Scores of the micro-batch's rows at `temperature` (with the reference's log-probs when there is one), and
        the micro-batch as the loss must see it (CP: this rank's slice)."""
        packed, loss_micro = self._forward(self.model, micro, temperature)
        scores = TokenScores.unpack(packed)
        if self.reference is not None:
            with torch.no_grad():
                scores.reference = TokenScores.unpack(self._forward(self.reference, micro, temperature)[0]).logprobs
        return scores, loss_micro

    @torch.no_grad()
    def score(self, micro: MicroBatch, temperature: float) -> torch.Tensor:
        """The micro-batch's token log-probs under the policy now, without gradient ([B, T]; context parallel:
        this rank's slice)."""
        packed, _ = self._forward(self.model, {k: v.to(self.info.device) for k, v in micro.items()}, temperature)
        return TokenScores.unpack(packed).logprobs.detach()

    def _forward(
        self, model: torch.nn.Module, micro: MicroBatch, temperature: float
    ) -> tuple[torch.Tensor, MicroBatch]:
        head: ScoresHead = model.lm_head
        head.targets, head.temperature = next_tokens(micro["input_ids"]), temperature
        routes = micro.get(ROUTES_FIELD) if model is self.model and self.replays else None
        try:
            if self.context is None:
                # use_cache=False matters: with a KV cache transformers skips the block-causal mask of packed rows
                with replaying(model, routes):
                    out = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False)
                return out.logits, micro
            if routes is not None:
                raise ValueError("routing replay with context parallel is not supported (config: parallelism.cp=1)")
            head.targets = self.context.local(head.targets)
            with self.context.inputs(micro) as (input_ids, position_ids):
                out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            return self.context.loss_inputs(out.logits, micro)
        finally:
            head.targets = None

    def step(
        self, index: int, micro_batches: list[MicroBatch], loss_fn: LossFn, temperature: float = 1.0
    ) -> StepResult:
        """Collective: forward/backward over this rank's micro-batches (scored at `temperature`), clip, and the AdamW
        step unless not finite. `index` names the step in the warning and error about non-finite steps."""
        if not micro_batches:
            raise ValueError("every rank needs at least one micro-batch (pad with loss-free ones)")
        sums: dict[str, float] = {}
        forward_s = backward_s = 0.0
        self._note_routes(micro_batches)
        for micro in micro_batches:
            started = time.perf_counter()
            if self.replays:
                sums["replayed"] = sums.get("replayed", 0.0) + replayed_tokens(
                    micro.get(ROUTES_FIELD), micro["loss_mask"]
                )
            scores, micro = self._scores({k: v.to(self.info.device) for k, v in micro.items()}, temperature)
            loss, parts = loss_fn(scores, micro)
            if self.info.is_main and failpoint("trainer.nonfinite_loss"):
                loss = loss * float("nan")
            backward_at = time.perf_counter()
            forward_s += backward_at - started
            (loss * self.info.world_size).backward()
            backward_s += time.perf_counter() - backward_at
            for key, value in {"loss": loss.item(), **parts}.items():
                sums[key] = max(sums.get(key, value), value) if key.endswith(MAX_SUFFIX) else sums.get(key, 0.0) + value
        optimizer_at = time.perf_counter()
        scale_expert_grads(self.expert_params, self.info.world_size)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        sums = all_reduce_sums(sums, self.info.device)
        applied = math.isfinite(grad_norm) and math.isfinite(sums["loss"])
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._count_skipped(index, applied, sums["loss"], grad_norm)
        return StepResult(sums, grad_norm, applied, forward_s, backward_s, time.perf_counter() - optimizer_at)

    def _note_routes(self, micro_batches: list[MicroBatch]) -> None:
        """Say once when routing replay is on and a step's micro-batches carry no routed experts (the trainer's own
        router routes them; the `replayed_fraction` metric shows it per step)."""
        if self.replays and not self._warned_no_routes and all(ROUTES_FIELD not in mb for mb in micro_batches):
            self._warned_no_routes = True
            if self.info.is_main:
                log.warning(
                    "trainer.moe.routing_replay: this batch carries no routed experts; the trainer's router routes it"
                )

    def _count_skipped(self, index: int, applied: bool, loss: float, grad_norm: float) -> None:
        if applied:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        if self.info.is_main:
            log.warning(
                f"step {index}: loss {loss} / grad norm {grad_norm} not finite: update skipped "
                f"({self.skipped_in_a_row} in a row; at most {self.max_nonfinite_steps})"
            )
        if self.skipped_in_a_row >= self.max_nonfinite_steps:
            raise RunError(
                f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm (last: "
                f"step {index}); the run stops at its last finite checkpoint"
            )

    def restore(self, path: Path) -> dict:
        """Collective: model and optimizer state from the checkpoint at `path`; returns its trainer_state.json."""
        return load_checkpoint(self.model, self.optimizer, path)

    def export(self, out_dir: str | Path, merged: bool = False) -> None:
        """Collective: write the full weights as an HF directory (with the base model's config and tokenizer), or
        with LoRA the adapter alone in peft's format (only the adapters are gathered; `merged`: the full weights
        with the adapters merged in), atomically and STABLE-marked, from rank 0."""
        adapter_only = self.lora is not None and not merged
        state = full_state_dict(self.model, trained_only=adapter_only)
        if self.info.is_main and adapter_only:
            adapters = {k: v for k, v in state.items() if is_adapter_param(k)}
            save_adapter(adapters, self.lora, self.base, out_dir, dtype=self.export_dtype)
        elif self.info.is_main:
            if self.lora is not None:
                state = merge_adapters(state, self.lora)
            save_hf_checkpoint({k: v.to(self.export_dtype) for k, v in state.items()}, self.base, out_dir)
        dist.barrier()
