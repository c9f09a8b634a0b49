"""Trainer checkpoints (model + optimizer as a safetensors DCP): exact round trip across world sizes, refusal of
damaged or unfinished checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from primerl.trainer.checkpoint import CorruptCheckpoint, latest_checkpoint, verify_checkpoint
from primerl.transport.atomic import STABLE_MARKER
from primerl.transport.run_dir import checkpoint_path
from tests.conftest import run_module

pytestmark = pytest.mark.slow


def _worker(mode: str, run_dir, nproc: int):
    result = run_module("tests.workers.checkpoint_roundtrip", mode, str(run_dir), torchrun=nproc, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_checkpoint_round_trip_reshards_and_refuses_damage(tmp_path):
    _worker("save", tmp_path, nproc=2)
    ckpt = checkpoint_path(tmp_path, 2)
    state = verify_checkpoint(ckpt)
    assert state["step"] == 2 and state["world_size"] == 2 and state["metrics"] == {"loss": 1.0}
    assert all(name.endswith(".safetensors") for name in state["files"])  # no pickles
    assert ckpt.stat().st_mode & 0o777 == 0o700  # the user's alone, as the run directory
    saved = load_file(tmp_path / "saved.safetensors")
    assert any(k.endswith("exp_avg_sq") for k in saved) and any(k.endswith(".step") for k in saved)
    assert saved["optim.model.embed_tokens.weight.step"].item() == 2.0
    for nproc in (1, 2):  # saved on 2 ranks, restored on 1 and on 2
        _worker("load", tmp_path, nproc)
        restored = load_file(tmp_path / f"restored-{nproc}.safetensors")
        assert restored.keys() == saved.keys()
        for key, value in saved.items():
            torch.testing.assert_close(restored[key], value, rtol=0, atol=0, msg=key)

    # an unfinished save (no STABLE marker) is never picked
    unfinished = checkpoint_path(tmp_path, 3)
    shutil.copytree(ckpt, unfinished)
    (unfinished / STABLE_MARKER).unlink()
    assert latest_checkpoint(tmp_path) == 2

    # one flipped byte in a shard: refused before any tensor is read
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=f"{shard.name} does not match"):
        verify_checkpoint(ckpt)
    result = run_module("tests.workers.checkpoint_roundtrip", "load", str(tmp_path), torchrun=1, timeout=300)
    assert result.returncode != 0 and "is corrupt" in result.stderr
    # a missing state file
    (ckpt / "trainer_state.json").write_text("{")
    with pytest.raises(CorruptCheckpoint, match="unreadable trainer_state.json"):
        verify_checkpoint(ckpt)
    assert json.loads((unfinished / "trainer_state.json").read_text())["step"] == 2


def test_async_checkpoint_holds_the_state_it_was_asked_for(tmp_path):
    """trainer.checkpoint_async: the writer thread saves over a gloo group of its own while the next step trains
    (FSDP2's all-gathers and reduce-scatters on the default group) and changes every tensor in place; the checkpoint
    still restores the state of step 2, exactly, on 2 ranks."""
    _worker("save-async", tmp_path, nproc=2)
    state = verify_checkpoint(checkpoint_path(tmp_path, 2))
    assert state["step"] == 2 and state["world_size"] == 2 and state["metrics"] == {"loss": 1.0}
    assert not list(tmp_path.glob("checkpoints/.*partial"))
    saved = load_file(tmp_path / "saved.safetensors")
    assert saved["optim.model.embed_tokens.weight.step"].item() == 2.0
    _worker("load", tmp_path, nproc=2)
    restored = load_file(tmp_path / "restored-2.safetensors")
    assert restored.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(restored[key], value, rtol=0, atol=0, msg=key)
