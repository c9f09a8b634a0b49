"""The chaos soak's faults a run must go on through (benchmarks/chaos_soak.py `Soak.ride`): how each is injected
into the running run. The run is then expected to train on without a rerun."""

import os
import signal
import time
from typing import TYPE_CHECKING

from benchmarks.chaos_faults import OUTAGE_S, ROOT, arm_nonfinite_step, second_run, target_pid, wait_for

if TYPE_CHECKING:
    from benchmarks.chaos_soak import Soak


def inject(soak: "Soak", kind: str) -> dict:
    """Inject fault `kind` into `soak`'s run and return what the fault's record adds (a second run's outcome). Waits
    for a failpoint to fire, or for an outage to end, before returning."""
    failpoints = soak.failpoints
    if kind == "vllm":
        pid = target_pid(kind, soak.run, soak.driver)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    elif kind == "vllm_mid_transfer":  # the vLLM worker kills itself -9 in its next collective transfer
        failpoints.mkdir(parents=True, exist_ok=True)
        (failpoints / "worker.die_mid_transfer").touch()
        wait_for(lambda: not (failpoints / "worker.die_mid_transfer").exists() or not soak.alive(), 300)
    elif kind == "nan_step":
        arm_nonfinite_step(failpoints)
        wait_for(lambda: not (failpoints / "trainer.nonfinite_loss").exists() or not soak.alive(), 300)
    elif kind == "slow_env":  # every rollout waits 2 s first, for OUTAGE_S
        failpoints.mkdir(parents=True, exist_ok=True)
        (failpoints / "env.slow").touch()
        time.sleep(OUTAGE_S)
        (failpoints / "env.slow").unlink()
    elif kind == "second_run":
        return {"second": second_run(soak.cmd, ROOT, soak.work / f"second-{len(soak.faults)}", failpoints)}
    elif kind == "store_down":
        soak.server.kill()
        time.sleep(OUTAGE_S)
        soak.server.start()
    elif kind == "store_locked":
        soak.server.lock(OUTAGE_S).join()
    elif kind == "disk_full":
        soak.disk.fill()
        time.sleep(OUTAGE_S)
        soak.disk.free()
    else:
        raise ValueError(f"not a fault the run rides through: {kind}")
    return {}
