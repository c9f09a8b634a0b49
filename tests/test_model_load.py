"""The trainer builds its model on the meta device and fills only each rank's shards (primerl.trainer.model_load):
the weights equal `from_pretrained`'s on 1 and 2 ranks, for a dense model (sharded read), a MoE model whose experts
are stored one tensor per expert (sharded read, EP over 2 ranks) and a checkpoint whose names are not the model's
(rank 0 reads and scatters); rotary buffers and tied embeddings survive."""

import json

import pytest
from transformers import AutoModelForCausalLM

from primerl.config.model import TinyArchConfig
from primerl.model.tiny import build_tiny_model
from primerl.trainer.model_load import StoredTensors
from tests.conftest import run_module

pytestmark = pytest.mark.slow


def _model_dirs(cache_dir, tmp_path) -> dict:
    dense = build_tiny_model(str(cache_dir), TinyArchConfig(), init_seed=0, dtype="bfloat16")
    moe = build_tiny_model(str(cache_dir), TinyArchConfig(num_experts=4, num_experts_per_tok=2), init_seed=0)
    renamed = tmp_path / "renamed"  # the base model alone: names without the "model." prefix, no lm_head
    AutoModelForCausalLM.from_pretrained(dense).model.save_pretrained(renamed)
    assert "layers.0.mlp.up_proj.weight" in StoredTensors(renamed)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in StoredTensors(moe)
    return {"dense": dense, "moe": moe, "renamed": renamed}


def test_each_rank_loads_its_shards_equal_to_from_pretrained(cache_dir, tmp_path):
    dirs = _model_dirs(cache_dir, tmp_path)
    for nproc in (1, 2):
        result = run_module("tests.workers.model_load", str(tmp_path), *map(str, dirs.values()), torchrun=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        for name, base in dirs.items():
            found = json.loads((tmp_path / f"{base.name}-{nproc}.json").read_text())
            assert found == {"weights_differ": [], "buffers_differ": [], "tied": True}, (name, nproc)
        loads = [line for line in result.stdout.splitlines() if "loaded " in line and " rank(s): " in line]
        assert [line.rsplit(": ", 1)[1] for line in loads] == [
            "sharded read",
            "sharded read",
            "rank 0 read and scattered",
        ], loads
