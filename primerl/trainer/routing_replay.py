"""Rollout routing replay (R3) for MoE models (`trainer.moe.routing_replay`).

A MoE router picks each token's top-k experts from its logits; the inference engine and the trainer compute those
logits with different kernels (and bf16 against fp32), so near-ties fall the other way and the trainer's forward
runs other experts than the ones that sampled the token: a policy mismatch that grows with the number of layers and
experts. With replay, the trainer routes each token to the experts the engine chose (`routed_experts` in the
batch), while the gate weights stay the router's own softmax at those experts, so the router keeps its gradient.

Invariants (tests/test_routing_replay.py):
- routes equal to the router's own top-k give the same outputs as no replay, bit for bit;
- a token whose route holds a negative id (padding, positions the engine did not return) uses the router's own
  top-k;
- only the replayed experts run a token: an expert no replayed route names gets no gradient from it.

Layout of `routed_experts` in a micro-batch: [rows, seq_len, moe_layers, k] integers, the MoE blocks in model order.
The reference policy (`trainer.loss.kl_coef`) routes by its own router: the engine's choices are the current
policy's, not the start model's.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from primerl.trainer.expert_parallel import moe_blocks


class ReplayRouter(nn.Module):
    """Takes the place of a Qwen3-MoE block's top-k router (`block.gate`), with the same weight Parameter (so the
    state dict keeps its keys). Returns what the router returns: (logits [N, E], gate weights [N, k], experts
    [N, k]); with `routes` set ([N, k], negative: no route), the experts are those and the weights the softmax at
    them (renormalised over the k when the model does so)."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.weight = router.weight
        self.top_k, self.num_experts = router.top_k, router.num_experts
        self.norm_topk_prob, self.hidden_dim = router.norm_topk_prob, router.hidden_dim
        self.routes: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.routes is not None:
            if self.routes.shape != experts.shape:
                raise ValueError(f"routed experts of shape {tuple(self.routes.shape)} for {tuple(experts.shape)}")
            replayed = (self.routes >= 0).all(-1, keepdim=True)
            experts = torch.where(replayed, self.routes.to(experts.dtype).clamp(min=0), experts)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE block, in model order."""
    return [block.gate for block in moe_blocks(model)]


def install_routing_replay(model: nn.Module) -> int:
    """Put a `ReplayRouter` in place of every MoE block's router (before sharding); returns how many."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("trainer.moe.routing_replay needs a MoE model; this one has no experts")
    for block in blocks:
        if not isinstance(block.gate, ReplayRouter):
            block.gate = ReplayRouter(block.gate)
    return len(blocks)


@contextmanager
def replaying(model: nn.Module, routes: torch.Tensor | None):
    """During the block: every `ReplayRouter` of `model` routes the tokens of this forward by `routes` ([rows,
    seq_len, layers, k]; None: by its own choice, and nothing to do: routes are cleared after every forward)."""
    if routes is None:
        yield
        return
    routers = [r for r in moe_routers(model) if isinstance(r, ReplayRouter)]
    if routes.dim() != 4 or routes.shape[2] != len(routers):
        raise ValueError(f"routed experts of shape {tuple(routes.shape)}: expected [rows, seq_len, {len(routers)}, k]")
    for layer, router in enumerate(routers):
        router.routes = routes[:, :, layer].reshape(-1, routes.shape[-1])
    try:
        yield
    finally:
        for router in routers:
            router.routes = None


def replayed_tokens(routes: torch.Tensor | None, loss_mask: torch.Tensor) -> int:
    """How many loss tokens (the first of a row never counts) were predicted from a position whose route is given in
    every MoE layer: what replay covered (0 without routes). The engine returns a route for every token it forwarded,
    all but the last sampled one, which predicts nothing the loss uses."""
    if routes is None:
        return 0
    given = (routes[:, :-1] >= 0).all(-1).all(-1)
    return int((given & loss_mask[:, 1:].bool()).sum())
