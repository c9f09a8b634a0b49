"""Failpoints: named places where a chaos test makes a running process fail on purpose, at a moment it chooses.

Off unless `PRIMERL_FAILPOINTS` names a directory (the chaos soak sets it; nothing else does). Then `failpoint(name)`
is True once for each file `<dir>/<name>` the test creates: the process removes the file as the fault fires, so
exactly one step sees it. Off, a call costs one environment lookup.

Failpoints: `trainer.nonfinite_loss` (the next step's loss on rank 0 is NaN: the update is skipped, as for a real
non-finite step); `worker.keep_old_weights` and `worker.die_mid_transfer` (an inference worker's next load is a
silent no-op, or kills the worker once a collective transfer began: primerl.inference.worker_extension).

Lasting faults (`lasting(name)`: True for as long as the file exists; the test removes it to end the fault):
`env.slow` (every rollout of an env waits SLOW_ENV_S first, as an env whose sandbox or judge answers slowly does:
primerl.envs.verifiers_env.run_episode); `server.dies_at_first_request` (a vLLM server started while it lasts exits
at its first generation request: primerl.inference.guard).
"""

import os
from pathlib import Path

FAILPOINTS_ENV = "PRIMERL_FAILPOINTS"


def lasting(name: str) -> bool:
    """Whether the lasting fault `name` is on now."""
    folder = os.environ.get(FAILPOINTS_ENV)
    return bool(folder) and (Path(folder) / name).exists()


def failpoint(name: str) -> bool:
    """Whether the fault `name` was armed (and now fires, once)."""
    folder = os.environ.get(FAILPOINTS_ENV)
    if not folder:
        return False
    try:
        os.unlink(Path(folder) / name)
    except FileNotFoundError:
        return False
    return True
