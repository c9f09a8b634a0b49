"""The tiny Qwen3 model and byte-level tokenizer, built locally so no run needs the hub.

Invariant: the same `TinyArchConfig` and `init_seed` always give the same weights, saved once in Hugging Face
format under `<cache_dir>/models/tiny-<hash>`; transformers and vLLM both load that directory.
"""

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from primerl.config.model import TinyArchConfig
from primerl.transport.atomic import atomic_dir
from primerl.utils.locks import locked

if TYPE_CHECKING:  # torch and transformers load only where a model or a tokenizer is built (~3 s of imports)
    from transformers import PreTrainedTokenizerFast

TOKENIZER_VERSION = 2  # bump when the tokenizer or template below changes: it is part of the cache key
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# Qwen3's chat format, tools included (the Hermes convention, shortened for a 512-position model): the tools' JSON in
# the system turn (keys sorted, so the prompt is the same whatever order a tool server lists them in), a call as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> in the assistant turn, a result as a user turn wrapped
# in <tool_response>. Without tools it renders exactly as version 1 did.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '<tools>\n' }}"
    "{%- for tool in tools %}{{- (tool['function'] if tool['function'] is defined else tool) | tojson(sort_keys=true) }}"
    "{{- '\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, so token id == byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(tool_call_tokens: bool = False) -> "PreTrainedTokenizerFast":
    """Byte-level tokenizer: ids 0-255 are bytes, then <|endoftext|>, <|im_start|>, <|im_end|>, and with
    `tool_call_tokens` <tool_call>, </tool_call> (one id each, which the renderers' Hermes tool parser needs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [END_OF_TEXT, IM_START, IM_END] + ([TOOL_CALL_START, TOOL_CALL_END] if tool_call_tokens else [])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def _hf_config(arch: TinyArchConfig, tokenizer: "PreTrainedTokenizerFast", dtype: str):
    common = dict(
        vocab_size=len(tokenizer),  # exactly the tokenizer: no id the policy can sample is undecodable
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        initializer_range=arch.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        dtype=dtype,
    )
    if arch.num_experts:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
    from transformers import Qwen3Config

    return Qwen3Config(**common)


def tiny_model_dir(cache_dir: str, arch: TinyArchConfig, init_seed: int, dtype: str) -> Path:
    key = json.dumps([dataclasses.asdict(arch), init_seed, dtype, TOKENIZER_VERSION], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(os.path.expanduser(cache_dir)) / "models" / f"tiny-{digest}"


def build_tiny_model(cache_dir: str, arch: TinyArchConfig, init_seed: int, dtype: str = "float32") -> Path:
    """Return the HF directory of the tiny model, building it on first use.

    Safe with several processes (torchrun ranks, parallel runs): one builds under a file lock, into a staging
    directory renamed into place; the others wait and find it complete.
    """
    target = tiny_model_dir(cache_dir, arch, init_seed, dtype)
    if (target / "config.json").exists():
        return target
    with locked(target):
        if (target / "config.json").exists():
            return target
        import torch
        from transformers import AutoModelForCausalLM

        tokenizer = build_tokenizer(arch.tool_call_tokens)
        config = _hf_config(arch, tokenizer, dtype)
        torch.manual_seed(init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        with atomic_dir(target, mark_stable=False) as staging:  # replaces a partial one left by a killed builder
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
    return target
