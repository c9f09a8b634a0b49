"""Under torchrun: `PRECISION LR STEPS OUT` trains the tiny model STEPS SFT-style steps (next-token loss on fixed
random rows, split over the ranks) through primerl's Trainer at `trainer.precision=PRECISION`, then writes the
losses and gradient norms to OUT/run-<precision>-<world>.json and the fp32 master weights (rank 0, full) to
OUT/weights-<precision>-<world>.safetensors."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from primerl.config.model import TinyArchConfig
from primerl.config.trainer import OptimConfig, TrainerConfig
from primerl.model.tiny import build_tiny_model
from primerl.trainer.dist import close_distributed, init_distributed, main_rank_first
from primerl.trainer.trainer import Trainer
from primerl.trainer.weights import full_state_dict

ROWS, LENGTH = 4, 32


def main(precision: str, lr: float, steps: int, out: Path) -> None:
    info = init_distributed("gloo")
    torch.manual_seed(0)
    base = main_rank_first(info, lambda: build_tiny_model(str(out / "cache"), TinyArchConfig(), 0))
    trainer = Trainer.build(base, info, OptimConfig(lr=lr), TrainerConfig(precision=precision, logprob_chunk_size=16))
    ids = torch.randint(0, 256, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    rows = ids[info.rank :: info.world_size]
    micro = {"input_ids": rows, "position_ids": torch.arange(LENGTH).expand_as(rows).contiguous()}
    tokens = ROWS * (LENGTH - 1)

    def loss_fn(scores, _micro):
        return -scores.logprobs[:, :-1].sum() / tokens, {}

    losses, norms = [], []
    for step in range(steps):
        result = trainer.step(step, [micro], loss_fn)
        losses.append(result.sums["loss"])
        norms.append(result.grad_norm)
    state = full_state_dict(trainer.model)
    if info.is_main:
        name = f"{precision}-{info.world_size}"
        (out / f"run-{name}.json").write_text(json.dumps({"losses": losses, "grad_norms": norms}))
        dtypes = sorted({str(p.dtype) for p in trainer.model.parameters()})
        save_file(
            {k: v.clone() for k, v in state.items()}, out / f"weights-{name}.safetensors", {"dtypes": str(dtypes)}
        )
    torch.distributed.barrier()  # as Trainer.export does: no rank tears its group down while another still uses it
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
