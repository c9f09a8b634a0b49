"""The peer run, executed inside TRL's own venv by `benchmarks/peer.py` (do not import it from primerl's venv).

    benchmarks/.venv-trl/bin/python benchmarks/trl_grpo.py MODEL_DIR OUT_DIR --steps N --batch B --group G --lr LR

TRL's GRPOTrainer on the same tiny model (primerl's SFT checkpoint), the same primerl-reverse-text tasks ("rl" stream of
the same seed), reward (LCS ratio), group size, samples per step, temperature 1 and new tokens (`--max-tokens`); beta=0 (no
reference model, as in primerl). Generation is TRL's HF `generate` (no vLLM server on this path). Writes the final
model to OUT_DIR and prints one JSON line with the wall time.
"""

import argparse
import json
import sys
import time
from pathlib import Path

# the primerl-reverse-text task definitions only (pure Python, no verifiers): the module itself, not its env package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments" / "primerl_reverse_text"))

from datasets import Dataset  # noqa: E402
from texts import lcs_ratio, make_texts, prompt_messages, stream_seed  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def lcs_reward(completions, text, **_) -> list[float]:
    return [lcs_ratio(c[-1]["content"] if isinstance(c, list) else c, t) for c, t in zip(completions, text)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--optim", default="adamw_torch", help="transformers optimizer name, e.g. sgd")
    args = p.parse_args()
    texts = make_texts(stream_seed(args.seed, "rl", 0), args.steps * args.batch // args.group)
    data = Dataset.from_list([{"prompt": prompt_messages(t), "text": t} for t in texts])
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.group,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        temperature=1.0,
        max_completion_length=args.max_tokens,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=args.seed,
        optim=args.optim,
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        max_grad_norm=1.0,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model),
        reward_funcs=lcs_reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(
        json.dumps(
            {
                "wall_s": wall,
                "first_reward": rewards[0] if rewards else None,
                "last_reward": rewards[-1] if rewards else None,
            }
        )
    )


if __name__ == "__main__":
    main()
