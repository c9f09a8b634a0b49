"""Format versions of what a run leaves on disk and a later release must read back to resume it.

- `CHECKPOINT_FORMAT`: `checkpoints/step_<n>/` (primerl.trainer.checkpoint): DCP safetensors shards whose tensors are
  named `model.<parameter>` and `optim.<parameter>.<state>`, and `trainer_state.json` (step, world size, metrics row,
  each file's size and sha256). Recorded in trainer_state.json as "format".
- `RUN_DIR_FORMAT`: the run directory's layout (primerl.transport.run_dir), the rollout batches' safetensors names
  and metadata (primerl.transport.batches), the metrics rows and `run_settings.json`. Recorded in `<run>/format.json`.

A change that a resume of an existing run would misread bumps its number. Reading refuses any other number with one
line naming both (`UnreadableFormat`), never a traceback from deep inside a load. What was written before these
numbers were recorded has the layout of format 1, and reads as 1. `tests/test_formats.py` resumes a small run
directory kept in the repository (tests/data/run_format_1), so a change that breaks resume fails in CI.
"""

from pathlib import Path

from primerl.utils.errors import RunError

CHECKPOINT_FORMAT = 1
RUN_DIR_FORMAT = 1


class UnreadableFormat(RunError):
    def __init__(self, what: str, path: Path, found: object, supported: int):
        if isinstance(found, int) and found > supported:
            advice = "it was written by a newer primerl: resume it with that release"
        elif isinstance(found, int):
            advice = "it was written by an older primerl: resume it with that release (its commit is in the ledger)"
        else:
            advice = "it was not written by primerl, or is damaged"
        super().__init__(
            f"{what} {path} has format {found!r}, this primerl reads format {supported}; {advice}, or start a new run"
        )


def check_format(found: object, supported: int, what: str, path: Path) -> None:
    """Refuse `found` (None: written before formats were recorded, i.e. format 1) unless it is `supported`."""
    found = 1 if found is None else found
    if found != supported:
        raise UnreadableFormat(what, path, found, supported)
