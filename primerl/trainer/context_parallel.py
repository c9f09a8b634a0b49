"""Context parallel (CP) that runs on CPU: each packed row's tokens are split over `cp` ranks; attention all-gathers
keys and values (torch's own `context_parallel` needs the CUDA SDPA kernels and does not run on CPU).

Rank c of a CP group holds tokens [c*L, (c+1)*L) of every row (L = seq_len / cp). Everything but attention is
per-token, so it runs on the local slice as is; rotary embeddings use the local slice of `position_ids`. In
attention, keys and values of the whole row are all-gathered (autograd: the backward all-reduces their gradients
and keeps the local part), and the local queries attend to them under the row's block-causal mask, rebuilt from
the row's full `position_ids` (a new document starts where a position is 0). The loss predicts token t+1 from
position t, so each rank also needs the first token of the next slice: `loss_inputs` builds that view.
Invariant: CP on N ranks computes the same logits, loss and gradients as 1 rank, up to float summation order.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "primerl_cp"


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence dim of [B, H, L, D]); backward sums gradients and keeps this slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.length = group, rank, local.shape[2]
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length], None, None, None


@dataclass
class _RowLayout:
    allowed: torch.Tensor  # [B, 1, L_local, L_full] bool: the block-causal mask of the local queries


_current: _RowLayout | None = None


def _cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if _current is None:
        raise RuntimeError("context-parallel attention called before any ContextParallel.inputs()")
    cp = ContextParallel.active
    key = _GatherSequence.apply(key, cp.group, cp.rank, cp.size)
    value = _GatherSequence.apply(value, cp.group, cp.rank, cp.size)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=_current.allowed, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class ContextParallel:
    """The CP group of this rank: ranks r with the same r // cp share each row, rank r holds slice r % cp."""

    active: "ContextParallel | None" = None

    def __init__(self, rank: int, world_size: int, size: int):
        if world_size % size:
            raise ValueError(f"world size {world_size} is not a multiple of cp={size}")
        self.size, self.rank = size, rank % size
        self.group = None
        for first in range(0, world_size, size):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                self.group = group
        AttentionInterface.register(ATTENTION_NAME, _cp_attention)
        ContextParallel.active = self

    @staticmethod
    def enable(model: torch.nn.Module) -> None:
        model.config._attn_implementation = ATTENTION_NAME

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-token field of the rows."""
        return self._slice(t)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        length = t.shape[1] // self.size
        return t[:, self.rank * length : (self.rank + 1) * length]

    @contextlib.contextmanager
    def inputs(self, micro: dict[str, torch.Tensor]):
        """Yield (input_ids, position_ids) of this rank's slice, with the attention mask of the slice in place."""
        global _current
        positions = micro["position_ids"]
        if positions.shape[1] % self.size:
            raise ValueError(f"row length {positions.shape[1]} is not divisible by cp={self.size}")
        document = torch.cumsum(positions == 0, dim=1)  # [B, S]
        index = torch.arange(positions.shape[1], device=positions.device)
        local_doc, local_index = self._slice(document), self._slice(index.unsqueeze(0))[0]
        allowed = (local_doc[:, :, None] == document[:, None, :]) & (local_index[:, None] >= index[None, :])
        # kept after the block, until the next micro-batch's: with activation checkpointing the backward runs
        # attention again, outside this block (Trainer.step runs each micro-batch's backward before the next forward)
        _current = _RowLayout(allowed.unsqueeze(1))
        yield self._slice(micro["input_ids"]), self._slice(positions)

    def loss_inputs(self, logits: torch.Tensor, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Scores (or logits) and per-token fields shaped so a loss (which predicts field[t+1] from scores[t])
        scores exactly this slice's predictions: the fields get the next slice's first token, the scores a dummy
        last column that the loss drops. The last slice's dummy target has loss_mask False."""
        length = logits.shape[1]
        start = self.rank * length
        fields = {}
        for key, value in micro.items():
            part = value[:, start : start + length + 1]
            if part.shape[1] == length:  # the last slice: nothing follows
                part = torch.cat([part, torch.zeros_like(part[:, :1])], dim=1)
            fields[key] = part
        return torch.cat([logits, torch.zeros_like(logits[:, :1])], dim=1), fields
