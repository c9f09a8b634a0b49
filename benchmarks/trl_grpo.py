"""The peer run, executed inside TRL's own venv by `benchmarks/peer.py` (do not import it from primerl's venv).

    benchmarks/.venv-trl/bin/python benchmarks/trl_grpo.py MODEL_DIR OUT_DIR --steps N --batch B --group G --lr LR

TRL's GRPOTrainer on the same tiny model (primerl's SFT checkpoint), the same primerl-reverse-text tasks ("rl" stream of
the same seed), reward (LCS ratio), group size, samples per step, temperature 1 and new tokens (`--max-tokens`); beta=0 (no
reference model, as in primerl). Generation is TRL's HF `generate` (no vLLM server on this path). Writes the final
model to OUT_DIR and prints one JSON line: the wall time of start-up (loading) and training, of which generation
(inside HF `generate`) and the rest (scoring, loss, backward, optimizer), the mean completion length, and the thread
settings the run saw.
"""

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()

# the primerl-reverse-text task definitions only (pure Python, no verifiers): the module itself, not its env package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments" / "primerl_reverse_text"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from texts import lcs_ratio, make_texts, prompt_messages, stream_seed  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402


def lcs_reward(completions, text, **_) -> list[float]:
    return [lcs_ratio(c[-1]["content"] if isinstance(c, list) else c, t) for c, t in zip(completions, text)]


def timed_generate(model) -> list[float]:
    """Wrap `model.generate` (what GRPOTrainer calls to sample) to add up its wall time into the returned list."""
    spent = [0.0]
    generate = model.generate

    @functools.wraps(generate)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    model.generate = timed
    return spent


def thread_settings() -> dict:
    """What decides how many threads torch runs on, and what it chose."""
    try:
        quota = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        quota = []
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cgroup_cpu_max": " ".join(quota) or None,
        **{key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }


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
    p.add_argument("--threads", type=int, help="torch's threads (default: its own choice, the cores it sees)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
    model = AutoModelForCausalLM.from_pretrained(args.model)
    generate_s = timed_generate(model)
    trainer = GRPOTrainer(
        model=model,
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
    history = trainer.state.log_history
    rewards = [h["reward"] for h in history if "reward" in h]
    lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    print(
        json.dumps(
            {
                "startup_s": started - STARTED,
                "wall_s": wall,
                "generate_s": generate_s[0],
                "completion_len": sum(lengths) / len(lengths) if lengths else None,
                "first_reward": rewards[0] if rewards else None,
                "last_reward": rewards[-1] if rewards else None,
                "threads": thread_settings(),
            }
        )
    )


if __name__ == "__main__":
    main()
