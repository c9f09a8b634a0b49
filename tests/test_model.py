"""The tiny model and tokenizer are built locally and round-trip through transformers."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.config.model import TinyArchConfig
from primerl.model.tiny import build_tiny_model, build_tokenizer, tiny_model_dir
from primerl.trainer.weights import save_hf_checkpoint


def test_tokenizer_is_byte_level_and_lossless():
    tok = build_tokenizer()
    text = "héllo wörld ✓ 12"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 258


def test_chat_template_renders_and_prompt_is_a_prefix():
    tok = build_tokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "abc"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "cba"}], tokenize=False)
    assert full.startswith(prompt)


def test_tiny_model_round_trip(cache_dir):
    arch = TinyArchConfig()
    path = build_tiny_model(str(cache_dir), arch, init_seed=3)
    assert path == tiny_model_dir(str(cache_dir), arch, 3, "float32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen3"
    assert model.config.hidden_size == arch.hidden_size
    assert tok.decode(tok.encode("abc", add_special_tokens=False)) == "abc"
    # weights on disk are what the model holds, and a second build is a cache hit with the same weights
    saved = load_file(path / "model.safetensors")
    for name, param in model.state_dict().items():
        if name in saved:
            torch.testing.assert_close(param, saved[name])
    assert build_tiny_model(str(cache_dir), arch, init_seed=3) == path
    other = build_tiny_model(str(cache_dir), arch, init_seed=4)
    assert other != path
    w3 = saved["model.embed_tokens.weight"]
    w4 = load_file(other / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(w3, w4)
    ids = torch.tensor([tok.encode("hello", add_special_tokens=False)])
    logits = model(ids).logits
    assert logits.shape == (1, 5, len(tok)) and torch.isfinite(logits).all()


def test_tiny_moe_builds(cache_dir):
    arch = TinyArchConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(str(cache_dir), arch, init_seed=0))
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4


def test_published_moe_weights_use_the_per_expert_layout_and_reload(cache_dir, tmp_path):
    """The trainer publishes transformers' fused expert tensors split per expert (the on-disk and vLLM layout)."""
    base = build_tiny_model(str(cache_dir), TinyArchConfig(num_experts=4, num_experts_per_tok=2), init_seed=0)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = save_hf_checkpoint(model.state_dict(), base, tmp_path / "step_000001")
    saved = load_file(out / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in saved
    assert not any(k.endswith("experts.gate_up_proj") for k in saved)
    assert saved.keys() == load_file(base / "model.safetensors").keys()  # same layout as the base checkpoint
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
