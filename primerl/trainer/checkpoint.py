"""Trainer checkpoints: model and optimizer state as a torch distributed checkpoint (DCP) in safetensors.

`<run>/checkpoints/step_<n>/` holds the state after n trainer steps. Every rank writes its own shards through
`HuggingFaceStorageWriter` (safetensors, JSON headers: no pickles on save or load), then rank 0 writes
`trainer_state.json` (the step, the step's metrics row, each file's size and sha256) and the STABLE marker, and
renames the directory into place. Invariants:
- a directory without STABLE is never loaded (a crash mid-save leaves only a `.primerl-tmp-step_*.partial` directory);
- a STABLE directory whose files do not match their recorded sizes and digests is refused (`CorruptCheckpoint`);
- loading reshards, so a run may resume on another number of ranks.
Optimizer hyperparameters come from the config on resume; only the per-parameter state (step, moments) is saved.

`AsyncCheckpointer` writes the same checkpoint off the training thread (`trainer.checkpoint_async`): the state is
copied in memory (the only part on the critical path), and a writer thread saves, digests and marks it STABLE while
the next step trains. At most one is in flight; the next save, and the end of training, wait for it first. A kill
while one is in flight leaves it unmarked, so the run resumes from the one before and replays the steps since from
their stored batches: no trained step is lost, and at most `checkpoint_every` steps are trained again.
"""

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from primerl.transport.atomic import atomic_dir, latest_stable, remove_published, shared_staging_path, stable_steps
from primerl.transport.formats import CHECKPOINT_FORMAT, check_format
from primerl.transport.run_dir import CHECKPOINT_STATE_FILE, checkpoint_path, checkpoints_root
from primerl.utils.errors import RunError, writing
from primerl.utils.log import get_logger

log = get_logger("trainer")


class CorruptCheckpoint(RunError):
    def __init__(self, path: Path, why: str):
        super().__init__(f"checkpoint {path} is corrupt ({why})")
        self.path = path


def latest_checkpoint(run_dir: str | Path) -> int | None:
    return latest_stable(checkpoints_root(run_dir))


def restore_sound(restore: Callable[[Path], dict], run_dir: str | Path, is_main: bool) -> tuple[int, dict]:
    """Collective: (step, trainer_state.json) of the newest checkpoint `restore` loads; (0, {}) when there is none.
    A damaged one (files not as recorded: a shared filesystem that delivered it truncated or not at all, a disk
    error) is logged, set aside by rank 0 as `damaged-step_<n>-<ns>` once a sound one is loaded, and the one before it is
    taken: the steps since are trained again from their stored batches, as after a kill during an asynchronous
    write. Every checkpoint damaged: CorruptCheckpoint (starting over from the base model is the user's decision)."""
    damaged: list[Path] = []
    for step in stable_steps(checkpoints_root(run_dir)):
        try:
            state = restore(checkpoint_path(run_dir, step))
        except CorruptCheckpoint as err:
            if is_main:
                log.warning(f"{err}; resuming from the checkpoint before it")
            damaged.append(err.path)
            continue
        if is_main:
            for path in damaged:
                path.rename(path.with_name(f"damaged-{path.name}-{time.time_ns()}"))  # out of later resumes' way
        return step, state
    if damaged:
        raise CorruptCheckpoint(damaged[-1], "and every checkpoint after it: no sound checkpoint to resume from")
    return 0, {}


def _flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, dict]:
    """(flat tensor dict for DCP, the model and optimizer state dicts whose tensors it shares).

    Tensors that share storage (a tied LM head and its embedding) appear once: safetensors refuses aliases, and
    loading the first in place loads both."""
    model_state, optim_state = get_state_dict(model, optimizer)
    named = [(f"model.{k}", v) for k, v in model_state.items()]
    named += [(f"optim.{fqn}.{name}", v) for fqn, s in optim_state["state"].items() for name, v in s.items()]
    flat, seen = {}, set()
    for key, value in named:
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.numel() and local.data_ptr() in seen:
            continue
        seen.add(local.data_ptr())
        flat[key] = value
    return flat, model_state, optim_state


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    run_dir: str | Path,
    step: int,
    metrics: dict,
    keep: int,
    is_main: bool,
) -> Path:
    """Collective: every rank calls it. Keeps the newest `keep` checkpoints."""
    flat, _, _ = _flat_state(model, optimizer)
    return _write(flat, run_dir, step, metrics, keep, is_main, group=None)


def _write(
    flat: dict, run_dir: str | Path, step: int, metrics: dict, keep: int, is_main: bool, group: dist.ProcessGroup | None
) -> Path:
    """Collective over `group`: stage, save, digest, mark STABLE, rename into place, drop old ones."""
    target = checkpoint_path(run_dir, step)
    # rank 0 stages, digests, marks STABLE and renames; a failed write (full disk) leaves no staging directory behind
    with atomic_dir(target, shared=True) if is_main else nullcontext(shared_staging_path(target)) as staging:
        dist.barrier(group=group)  # the staging directory exists
        writer = HuggingFaceStorageWriter(str(staging), save_distributed=True)
        dcp.save(flat, storage_writer=writer, process_group=group)
        dist.barrier(group=group)
        if is_main:
            files = {p.name: {"bytes": p.stat().st_size, "sha256": _file_digest(p)} for p in sorted(staging.iterdir())}
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "world_size": dist.get_world_size(),
                "metrics": metrics,
                "files": files,
            }
            (staging / CHECKPOINT_STATE_FILE).write_text(json.dumps(state, indent=1))
    if is_main:
        for old in sorted(target.parent.glob("step_*"))[:-keep]:
            remove_published(old)
    dist.barrier(group=group)
    return target


class Checkpointer:
    """Writes the trainer's checkpoints (`save_checkpoint`); `save` returns once the checkpoint is STABLE. Every rank
    makes one and calls `save` for the same steps. Used as a context manager around the step loop: leaving it waits
    for any write still in flight, and if the loop is failing, logs that write's failure instead of raising it (the
    loop's error is the one to report)."""

    def __init__(self, run_dir: str | Path, keep: int, is_main: bool):
        self.run_dir, self.keep, self.is_main = run_dir, keep, is_main

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, metrics: dict) -> None:
        """Collective."""
        save_checkpoint(model, optimizer, self.run_dir, step, metrics, self.keep, self.is_main)

    def close(self, quiet: bool = False) -> None:
        """Wait for the write in flight, if any; `quiet` logs its failure instead of raising it."""

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self.close(quiet=error_type is not None)


class AsyncCheckpointer(Checkpointer):
    """Checkpoints written by one writer thread, over a gloo group of their own (the training thread's collectives
    run meanwhile on the default group)."""

    def __init__(self, run_dir: str | Path, keep: int, is_main: bool):
        super().__init__(run_dir, keep, is_main)
        self.group = dist.new_group(backend="gloo")
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.in_flight: tuple[int, Future] | None = None

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, metrics: dict) -> None:
        """Collective. Returns once the state is copied; raises what the previous save raised."""
        self.wait()
        flat, _, _ = _flat_state(model, optimizer)
        # a copy in host memory (on a GPU: not a second copy on the device); DTensors stay DTensors, so DCP reshards
        copy = {key: value.detach().to("cpu", copy=True) for key, value in flat.items()}
        future = self.writer.submit(
            _write, copy, self.run_dir, step, dict(metrics), self.keep, self.is_main, self.group
        )  # the caller adds timings to its metrics
        self.in_flight = (step, future)

    def wait(self) -> None:
        """Block until the checkpoint in flight is STABLE, or raise a RunError that says why it is not."""
        if self.in_flight is not None:
            (step, future), self.in_flight = self.in_flight, None
            with writing(f"checkpoint of step {step}", "it is not marked STABLE"):
                future.result()

    def close(self, quiet: bool = False) -> None:
        try:
            self.wait()
        except RunError as err:
            if not quiet:
                raise
            log.warning(str(err))
        finally:
            self.writer.shutdown()


def make_checkpointer(run_dir: str | Path, keep: int, is_main: bool, asynchronous: bool) -> Checkpointer:
    """Collective when `asynchronous` (it makes the writer's process group)."""
    return (AsyncCheckpointer if asynchronous else Checkpointer)(run_dir, keep, is_main)


def verify_checkpoint(path: Path) -> dict:
    """The checkpoint's trainer_state.json, after checking every recorded file's size and digest."""
    try:
        state = json.loads((path / CHECKPOINT_STATE_FILE).read_text())
        files = state["files"]
    except (OSError, ValueError, KeyError) as err:
        raise CorruptCheckpoint(path, f"unreadable {CHECKPOINT_STATE_FILE}: {err}") from err
    check_format(state.get("format"), CHECKPOINT_FORMAT, "checkpoint", path)
    for name, expected in files.items():
        file = path / name
        if not file.exists():
            raise CorruptCheckpoint(path, f"{name} is missing")
        if file.stat().st_size != expected["bytes"] or _file_digest(file) != expected["sha256"]:
            raise CorruptCheckpoint(path, f"{name} does not match its recorded size and sha256")
    return state


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict:
    """Collective: load model and optimizer state from `path` in place; returns its trainer_state.json. A checkpoint
    marked `weights_only` (a fork's start, primerl.launch.fork) loads the model alone and leaves the optimizer
    without state, as a fresh one is."""
    state = verify_checkpoint(path)
    flat, model_state, optim_state = _flat_state(model, optimizer)
    weights_only = state.get("weights_only", False)
    if weights_only:
        flat = {key: value for key, value in flat.items() if key.startswith("model.")}
    try:
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path)))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # a checkpoint from another model, or damage the digests could not see (torch's
        # CheckpointException is a BaseException)
        why = (str(err).splitlines() or [""])[0][:200]
        raise CorruptCheckpoint(path, f"{type(err).__name__}: {why} (a checkpoint of another model?)") from err
    if weights_only:
        set_model_state_dict(model, model_state)
        optimizer.state.clear()  # _flat_state made zero moments and one empty step; a fresh optimizer has neither
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return state
