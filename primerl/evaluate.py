"""`python -m primerl.evaluate MODEL_DIR [MODEL_DIR ...]`: held-out reverse-text reward of checkpoints.

Uses the held-out "eval" text stream (disjoint from SFT and RL texts). Reports the greedy reward and the reward
sampled at the RL temperature (what RL optimises), with its standard error over the prompts.

    python -m primerl.evaluate ~/.cache/primerl/sft/reverse_text-XXXX outputs/reverse_text/RUN/weights/step_000030
"""

import argparse
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from primerl.envs.reverse_text import lcs_ratio, make_texts, prompt_messages, stream_seed


@torch.no_grad()
def rewards(model_dir: str, texts: list[str], temperature: float, seed: int, max_new_tokens: int = 32) -> list[float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    out_rewards = []
    for i in range(0, len(texts), 64):
        chunk = texts[i : i + 64]
        prompts = [tokenizer.apply_chat_template(prompt_messages(t), tokenize=False, add_generation_prompt=True)
                   for t in chunk]  # fmt: skip
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **sampling)  # fmt: skip
        for text, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
            out_rewards.append(lcs_ratio(tokenizer.decode(ids, skip_special_tokens=True), text))
    return out_rewards


def summary(values: list[float]) -> str:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
    return f"{mean:.4f} ± {sd / math.sqrt(len(values)):.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m primerl.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--num", type=int, default=512, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=0, help="run seed: selects the held-out stream")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--min-len", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=8)
    args = parser.parse_args(argv)
    missing = [m for m in args.models if not (Path(m) / "config.json").exists()]
    if missing:
        raise SystemExit(f"evaluate: not a Hugging Face model directory (no config.json): {', '.join(missing)}")
    texts = make_texts(stream_seed(args.seed, "eval"), args.num, args.min_len, args.max_len)
    print(f"{'model':<60} {'greedy':>16} {f'sampled T={args.temperature:g}':>18}")
    for model in args.models:
        greedy = rewards(model, texts, 0.0, args.seed)
        sampled = rewards(model, texts, args.temperature, args.seed)
        print(f"{model[-60:]:<60} {summary(greedy):>16} {summary(sampled):>18}", flush=True)


if __name__ == "__main__":
    main()
