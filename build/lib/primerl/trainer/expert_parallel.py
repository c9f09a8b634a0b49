"""Expert parallel (EP) for Qwen3-MoE blocks: each rank holds num_experts/ep experts; tokens travel to them.

For every MoE block, `apply_expert_parallel` replaces the experts module by `ExpertParallelExperts`, whose
`gate_up_proj` / `down_proj` are DTensors sharded on the expert dimension over the EP mesh (so checkpoints,
published weights and grad-norm clipping see the full tensors). Forward, per block:
  1. each (token, k) routing choice goes to the rank owning its expert (all-to-all of the hidden states, with
     autograd; the counts and local expert ids travel by a plain all-to-all first);
  2. the rank runs its experts on what it received;
  3. the outputs come back by the reverse all-to-all, are weighted by the router and summed per token.
No token is dropped (no capacity factor), so EP on N ranks computes what 1 rank computes, up to float summation
order. Invariant for gradients: expert parameters are not FSDP-managed, so FSDP's average over ranks does not
reach them; `scale_expert_grads` applies the same 1/world factor after backward.
Supported layout: ep == dp_shard (experts sharded over all data-parallel ranks) with cp == 1.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single as differentiable_all_to_all
from torch.distributed.tensor import Shard, distribute_tensor


class ExpertParallelExperts(nn.Module):
    def __init__(self, experts: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh
        self.group = mesh.get_group()
        self.ep = mesh.size()
        self.num_experts = experts.num_experts
        if self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts cannot be split over {self.ep} ranks")
        self.local_experts = self.num_experts // self.ep
        self.act_fn = experts.act_fn
        self.gate_up_proj = nn.Parameter(distribute_tensor(experts.gate_up_proj.detach(), mesh, [Shard(0)]))
        self.down_proj = nn.Parameter(distribute_tensor(experts.down_proj.detach(), mesh, [Shard(0)]))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, top_k = top_k_index.shape
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # grouped by expert, hence by destination rank
        token_of = order // top_k
        send_counts = torch.bincount(flat_expert[order] // self.local_experts, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        local_ids = (flat_expert[order] % self.local_experts).contiguous()
        recv_ids = torch.empty(sum(recv_splits), dtype=local_ids.dtype, device=local_ids.device)
        dist.all_to_all_single(recv_ids, local_ids, recv_splits, send_splits, group=self.group)
        received = differentiable_all_to_all(
            torch.empty(
                sum(recv_splits), hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device
            ),
            hidden_states[token_of].contiguous(),
            recv_splits,
            send_splits,
            group=self.group,
        )
        outputs = self._run_local_experts(received, recv_ids)
        returned = differentiable_all_to_all(
            torch.empty_like(hidden_states[token_of]), outputs, send_splits, recv_splits, group=self.group
        )
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, token_of, returned * weights)

    def _run_local_experts(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        out = torch.zeros(rows.shape[0], down.shape[1], dtype=rows.dtype, device=rows.device)
        for e in range(self.local_experts):
            idx = (expert_ids == e).nonzero().squeeze(-1)
            if idx.numel() == 0:
                # still touch the weights, so every rank's autograd graph has the same collectives and shapes
                out = out + 0.0 * (gate_up.sum() + down.sum())
                continue
            gate, up = F.linear(rows[idx], gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, idx, F.linear(self.act_fn(gate) * up, down[e]))
        return out


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard every MoE block's experts over `mesh`; returns the expert parameters (to keep out of FSDP)."""
    params: set[nn.Parameter] = set()
    for block in moe_blocks(model):
        block.experts = ExpertParallelExperts(block.experts, mesh)
        params |= {block.experts.gate_up_proj, block.experts.down_proj}
    if not params:
        raise ValueError("expert parallel needs a MoE model; this one has no experts")
    return params


def scale_expert_grads(params: set[nn.Parameter], world_size: int) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.div_(world_size)
