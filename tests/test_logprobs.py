"""Scoring tokens in chunks (primerl/trainer/logprobs.py) equals the full-vocabulary path, values and gradients; the
trainer's model returns scores, never logits; bf16 mixed precision keeps fp32 master weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from primerl.config.model import TinyArchConfig
from primerl.model.tiny import build_tiny_model
from primerl.trainer.logprobs import ScoresHead, TokenScores, chunked_scores, full_scores, next_tokens


def assert_within_1e6(got: torch.Tensor, want: torch.Tensor) -> None:
    """|got - want| <= 1e-6 x the larger of 1 and the tensor's largest magnitude: fp32 keeps ~7 digits, and the
    chunks sum a weight's gradient over tokens in another order than one matmul does."""
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= 1e-6 * scale, ((got - want).abs().max().item(), scale)


def _case(dtype: torch.dtype = torch.float32, rows: int = 3, length: int = 37, width: int = 16, vocab: int = 301):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, length, width, generator=generator, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, width, generator=generator, dtype=torch.float64) / 2).to(dtype)
    targets = torch.randint(0, vocab, (rows, length), generator=generator)
    return hidden.requires_grad_(), weight.requires_grad_(), targets


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_scores_equal_the_full_path(chunk, temperature):
    """Values and gradients within 1e-6 of log_softmax over the whole [B, T, V] logits, for chunks that divide the
    tokens, that do not, of one token and of more than all; entropy too (it carries no gradient)."""
    hidden, weight, targets = _case()
    upstream = torch.randn(hidden.shape[:2], generator=torch.Generator().manual_seed(1))  # a loss's d/d logp

    full = full_scores(hidden @ weight.t(), targets, temperature)
    (full.logprobs * upstream).sum().backward()
    want_hidden, want_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    got = chunked_scores(hidden, weight, targets, temperature, chunk)
    (got.logprobs * upstream).sum().backward()
    assert_within_1e6(got.logprobs, full.logprobs)
    assert_within_1e6(got.entropy, full.entropy)
    assert not got.entropy.requires_grad
    assert_within_1e6(hidden.grad, want_hidden)
    assert_within_1e6(weight.grad, want_weight)


def test_chunked_scores_in_bf16_follow_the_bf16_logits():
    """In bf16 the logits come from the bf16 matmul, as the full path's would, and are scored in fp32."""
    hidden, weight, targets = _case(torch.bfloat16)
    full = full_scores(hidden @ weight.t(), targets)
    got = chunked_scores(hidden, weight, targets, 1.0, 16)
    assert got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs, full.logprobs, rtol=0, atol=1e-5)
    got.logprobs.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_the_scores_head_keeps_the_models_weights_tied_and_its_keys(cache_dir):
    """In place of lm_head, the model's forward returns [B, T, 2] scores equal to the logits' scores; the output
    embedding is still the input embedding when they were tied; the state dict has the same keys."""
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(cache_dir), TinyArchConfig(), 0))
    keys = set(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = full_scores(model(input_ids=ids).logits, next_tokens(ids))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.lm_head = ScoresHead(model.lm_head, chunk=5)
    model.lm_head.targets = next_tokens(ids)
    with torch.no_grad():
        got = TokenScores.unpack(model(input_ids=ids).logits)
    assert_within_1e6(got.logprobs, want.logprobs)
    assert_within_1e6(got.entropy, want.entropy)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert set(model.state_dict()) == keys


def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_gradients(cache_dir):
    """What `trainer.activation_checkpointing` turns on (Trainer.build): each decoder layer runs again in the
    backward instead of keeping its activations for it (fewer bytes saved for the backward), and the gradients are
    the ones without it."""
    base = build_tiny_model(str(cache_dir), TinyArchConfig(), 0)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    grads, calls, saved = {}, {}, {}
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(base)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mlp, count, kept = model.model.layers[0].mlp, [0], [0]

        def counted(*args, _forward=mlp.forward, _count=count, **kwargs):
            _count[0] += 1
            return _forward(*args, **kwargs)

        mlp.forward = counted
        model.lm_head = ScoresHead(model.lm_head, chunk=8)
        model.lm_head.targets = next_tokens(ids)

        def keep(t: torch.Tensor, kept=kept) -> torch.Tensor:
            kept[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            scores = TokenScores.unpack(model(input_ids=ids, use_cache=False).logits)
        scores.logprobs[:, :-1].sum().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters()}
        calls[checkpointing], saved[checkpointing] = count[0], kept[0]
    assert calls == {False: 1, True: 2}
    assert saved[True] < saved[False] / 2, saved
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=0, atol=1e-6, msg=name)
