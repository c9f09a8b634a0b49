"""Under torchrun: `save DIR` trains the tiny model two AdamW steps and checkpoints it; `save-async DIR` does the
same through AsyncCheckpointer and trains a third step while the checkpoint is written; `load DIR` restores the
checkpoint into a fresh model and optimizer (any world size) and writes the full restored state to
DIR/restored-<world>.safetensors. Each save writes the state it checkpointed to DIR/saved.safetensors."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from transformers import AutoModelForCausalLM

from primerl.config.model import TinyArchConfig
from primerl.model.tiny import build_tiny_model
from primerl.trainer.checkpoint import AsyncCheckpointer, load_checkpoint, save_checkpoint
from primerl.trainer.dist import close_distributed, data_mesh, init_distributed, main_rank_first, shard_model
from primerl.transport.run_dir import checkpoint_path


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in model_state.items()}
    out |= {f"optim.{fqn}.{n}": v for fqn, s in optim_state["state"].items() for n, v in s.items()}
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main(mode: str, run_dir: Path) -> None:
    info = init_distributed("gloo")
    torch.manual_seed(0)
    base = main_rank_first(info, lambda: build_tiny_model(str(run_dir / "cache"), TinyArchConfig(), 0))
    model = AutoModelForCausalLM.from_pretrained(base)
    shard_model(model, data_mesh(info, info.world_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 16))

    def train_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    if mode == "save":
        for _ in range(2):
            train_step()
        save_checkpoint(model, optimizer, run_dir, 2, {"loss": 1.0}, keep=2, is_main=info.is_main)
        name = "saved"
    elif mode == "save-async":
        checkpointer = AsyncCheckpointer(run_dir, keep=2, is_main=info.is_main)
        for _ in range(2):
            train_step()
        state = full_state(model, optimizer)
        metrics = {"loss": 1.0}
        checkpointer.save(model, optimizer, 2, metrics)
        metrics["added after the save"] = 0.0
        train_step()  # changes every parameter and moment in place while the writer thread saves step 2
        checkpointer.close()
        if info.is_main:
            save_file(state, run_dir / "saved.safetensors")
        close_distributed()
        return
    else:
        load_checkpoint(model, optimizer, checkpoint_path(run_dir, 2))
        name = f"restored-{info.world_size}"
    state = full_state(model, optimizer)
    if info.is_main:
        save_file(state, run_dir / f"{name}.safetensors")
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
