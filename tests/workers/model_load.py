"""Under torchrun: `OUT DIR...` builds primerl's Trainer on each model directory (EP over every rank for a MoE
model) and writes OUT/<dir name>-<world>.json: whether every weight and buffer equals `from_pretrained`'s (cast to
fp32), and whether the lm_head is still tied to the embedding."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from primerl.config.trainer import OptimConfig, TrainerConfig
from primerl.trainer.dist import close_distributed, init_distributed
from primerl.trainer.trainer import Trainer
from primerl.trainer.weights import full_state_dict
from primerl.utils.log import configure_logging


def compare(trainer: Trainer, state: dict[str, torch.Tensor], base: Path) -> dict:
    """Rank 0's comparison of the trainer's gathered weights `state` and its buffers with the reference load."""
    reference = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    buffers = dict(trainer.model.named_buffers())
    expected = reference.state_dict()
    return {
        "weights_differ": sorted(k for k, v in expected.items() if not torch.equal(state.get(k, v * 0 + 1), v)),
        "buffers_differ": sorted(k for k, v in reference.named_buffers() if not torch.equal(buffers[k], v)),
        "tied": trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight,
    }


def main(out: Path, bases: list[Path]) -> None:
    configure_logging()
    info = init_distributed("gloo")
    for base in bases:
        moe = AutoConfig.from_pretrained(str(base)).model_type.endswith("_moe")
        ep = info.world_size if moe and info.world_size > 1 else 1
        trainer = Trainer.build(base, info, OptimConfig(lr=1e-3), TrainerConfig(), ep=ep)
        state = full_state_dict(trainer.model)  # collective
        if info.is_main:
            result = compare(trainer, state, base)
            (out / f"{base.name}-{info.world_size}.json").write_text(json.dumps(result))
        torch.distributed.barrier()
    close_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
