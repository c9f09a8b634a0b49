"""Under torchrun: `BASE OUT STEPS` trains LoRA adapters (rank 8, every projection) on the model at BASE through
primerl's Trainer for STEPS SFT-style steps (next-token loss on fixed random rows, split over the ranks), then:
checkpoints and restores into a fresh trainer, publishes the adapter to OUT/adapter-<world>, and writes
OUT/lora-<world>.json: which parameters trained and hold optimizer state, whether the base weights are the stored
ones still, the trainer's next-token log-probs of the rows, the restored trainer's, and the losses."""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from primerl.config.model import LoraConfig
from primerl.config.trainer import OptimConfig, TrainerConfig
from primerl.trainer.checkpoint import save_checkpoint
from primerl.trainer.dist import close_distributed, init_distributed
from primerl.trainer.model_load import AdapterSpec
from primerl.trainer.trainer import Trainer
from primerl.trainer.weights import full_state_dict

ROWS, LENGTH = 4, 24


def rows() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "position_ids": torch.arange(LENGTH).expand_as(ids).contiguous()}


def logprobs(trainer: Trainer) -> list:
    """Every rank scores all rows (a collective forward); the values are the same on each."""
    with torch.no_grad():
        scores, _ = trainer._scores(rows(), 1.0)
    return scores.logprobs[:, :-1].tolist()


def build(base: Path, info, start: Path | None = None) -> Trainer:
    spec = AdapterSpec(LoraConfig(rank=8), start=start, seed=0)
    return Trainer.build(base, info, OptimConfig(lr=1e-2), TrainerConfig(logprob_chunk_size=16), adapter=spec)


def main(base: Path, out: Path, steps: int) -> None:
    info = init_distributed("gloo")
    world = info.world_size
    trainer = build(base, info)
    trained = sorted(name for name, p in trainer.model.named_parameters() if p.requires_grad)
    state_params = sum(1 for p in trainer.optimizer.param_groups[0]["params"] if p in trainer.optimizer.state)
    batch = rows()
    mine = {k: v[info.rank :: world] for k, v in batch.items()}
    tokens = ROWS * (LENGTH - 1)

    def loss_fn(scores, _micro):
        return -scores.logprobs[:, :-1].sum() / tokens, {}

    losses = [trainer.step(step, [mine], loss_fn).sums["loss"] for step in range(steps)]
    state_params = sum(1 for p in trainer.optimizer.param_groups[0]["params"] if p in trainer.optimizer.state)
    trained_logprobs = logprobs(trainer)
    checkpoint = save_checkpoint(trainer.model, trainer.optimizer, out / f"run-{world}", steps, {}, 1, info.is_main)
    trainer.export(out / f"adapter-{world}")
    full = full_state_dict(trainer.model)
    restored = build(base, info)
    restored.restore(checkpoint)
    restored_logprobs = logprobs(restored)
    from_adapter = build(base, info, start=out / f"adapter-{world}")  # a run starting from the published adapter
    from_adapter_logprobs = logprobs(from_adapter)
    if info.is_main:
        with safe_open(str(base / "model.safetensors"), framework="pt") as f:
            stored = {name: f.get_tensor(name).float() for name in f.keys()}
        wrapped = {name.replace(".base_layer.", "."): value for name, value in full.items() if ".lora_" not in name}
        result = {
            "trained": trained,
            "optimizer_state_params": state_params,
            "base_changed": sorted(k for k, v in stored.items() if not torch.equal(wrapped[k], v)),
            "losses": losses,
            "logprobs": trained_logprobs,
            "restored_logprobs": restored_logprobs,
            "from_adapter_logprobs": from_adapter_logprobs,
        }
        (out / f"lora-{world}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
