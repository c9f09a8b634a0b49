"""Held-out reward of a checkpoint on reverse-text: greedy decoding with transformers on one process."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.envs.reverse_text import lcs_ratio, prompt_messages


@torch.no_grad()
def reverse_text_reward(model_dir: str, texts: list[str], max_new_tokens: int = 32, batch_size: int = 32) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rewards = []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        prompts = [tokenizer.apply_chat_template(prompt_messages(t), tokenize=False, add_generation_prompt=True)
                   for t in chunk]  # fmt: skip
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        for text, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            rewards.append(lcs_ratio(tokenizer.decode(ids, skip_special_tokens=True), text))
    return sum(rewards) / len(rewards)
