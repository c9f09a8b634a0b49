"""Next-token log-probs and entropy, scored in chunks of tokens without the full-vocabulary tensor.

The losses need, at each position t of a packed row, log pi(token[t+1] | tokens <= t) (with gradient) and the entropy
of pi(. | tokens <= t) (logged, no gradient). Computed from logits, that is a rows x seq x vocab tensor in fp32, plus
its log_softmax and softmax: 151,936 x 4 bytes = 0.6 MB per token for Qwen3's vocabulary, 2.5 GB for each tensor of
one 4k-token row. `ScoresHead` takes the place of the model's `lm_head` and scores `chunk_size` tokens at a time
from the final hidden states: each chunk's logits live only while it is scored, and the backward recomputes them
chunk by chunk (saved for backward: the hidden states and one log-sum-exp per token). Peak extra memory is
chunk_size x vocab x 4 bytes (x3 in the backward) instead of the whole row's. The arithmetic is the full path's:
fp32 logits (from the hidden states and weight in the compute dtype) divided by the temperature; the full path's
values and gradients agree within 1e-6 (tests/test_logprobs.py).

Invariant of the layout: column t of the scores predicts token t+1; the last column's target is a dummy (0), which
every loss drops with the `[:, :-1]` / `[:, 1:]` shift.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # [B, T] fp32: log pi(token[t+1] | <= t), with gradient
    entropy: torch.Tensor  # [B, T] fp32: entropy of pi(. | <= t), no gradient
    reference: torch.Tensor | None = None  # [B, T] fp32: log pi_ref(token[t+1] | <= t) when the trainer has one

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "TokenScores":
        """From `ScoresHead`'s [B, T, 2] output."""
        return cls(packed[..., 0], packed[..., 1])


def next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """The target of each position: the token after it (the last position's: 0, a dummy)."""
    return torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)


def full_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> TokenScores:
    """The reference: log_softmax over the whole [B, T, V] logits in fp32."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return TokenScores(chosen, entropy)


class _ChunkedScores(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log-prob of each target [N], entropy [N]), `chunk` rows of
    logits at a time; the backward recomputes each chunk's logits from the saved log-sum-exp. In-place steps keep
    one chunk-sized buffer (plus the matmul's) alive at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            all_logp = _logits(hidden[start:end], weight, temperature)
            lse[start:end] = torch.logsumexp(all_logp, dim=-1)
            all_logp.sub_(lse[start:end, None])
            logp[start:end] = all_logp.gather(-1, targets[start:end, None]).squeeze(-1)
            # -sum_v p_v log p_v as a batched dot product: no chunk-sized product tensor
            probs = all_logp.exp()
            entropy[start:end] = -(probs.unsqueeze(1) @ all_logp.unsqueeze(2)).view(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            g = grad_logp[start:end]
            # d logp / d logits = onehot(target) - softmax, through the temperature: / T
            grad_logits = _logits(hidden[start:end], weight, ctx.temperature).sub_(lse[start:end, None]).exp_()
            grad_logits.mul_(-g[:, None]).scatter_add_(-1, targets[start:end, None], g[:, None])
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[start:end] = grad_logits @ weight
            if hidden.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), hidden[start:end])
            else:
                grad_weight.add_(grad_logits.t() @ hidden[start:end])
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk's logits in fp32 (from the matmul in the compute dtype), divided by the temperature: a fresh tensor."""
    logits = (hidden @ weight.t()).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def chunked_scores(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int
) -> TokenScores:
    """`full_scores(hidden @ weight.T, targets, temperature)` without the [B, T, V] tensor: hidden [B, T, H]."""
    rows, length, width = hidden.shape
    logp, entropy = _ChunkedScores.apply(hidden.reshape(-1, width), weight, targets.reshape(-1), temperature, chunk)
    return TokenScores(logp.view(rows, length), entropy.view(rows, length))


class ScoresHead(nn.Module):
    """Takes the place of a causal LM's bias-free `lm_head` (the same weight Parameter, so tied embeddings stay tied
    and the state dict keeps its keys): the model's forward returns [B, T, 2] scores (log-prob of `targets`,
    entropy) where it returned logits. Set `targets` and `temperature` before each forward (`Trainer` does)."""

    def __init__(self, lm_head: nn.Linear, chunk: int | None):
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the model's lm_head has a bias, which chunked scoring does not support")
        self.weight = lm_head.weight
        self.chunk = chunk
        self.targets: torch.Tensor | None = None
        self.temperature = 1.0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            raise RuntimeError("ScoresHead called without targets")
        if self.chunk is None:  # the whole micro-batch at once: the full path
            scores = full_scores(hidden @ self.weight.t(), self.targets, self.temperature)
        else:
            scores = chunked_scores(hidden, self.weight, self.targets, self.temperature, self.chunk)
        return torch.stack([scores.logprobs, scores.entropy.detach()], dim=-1)
