"""The vLLM servers of one process and the routers in front of them, started and stopped together: what the
inference process serves for a run (`primerl inference`) and what `primerl eval` serves to evaluate against.

Servers start side by side (each start is mostly waiting); with prefill/decode a router per pair goes in front of
the decode servers (none in a SLURM prefill job). At the end the routers stop first (their KV stores emptied: nothing
of them outlives the serving), then every server at once within one grace (primerl.inference.server).
"""

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from primerl.config.inference import InferenceConfig, PdRole
from primerl.inference.pd_router import PdRouter, start_routers
from primerl.inference.server import VllmServer, start_side_by_side, stop_side_by_side
from primerl.inference.vllm_args import ServerSpec
from primerl.transport.run_dir import log_path, scratch_prefix


def server_for(run_dir: str | Path, spec: ServerSpec, node: str | None = None) -> VllmServer:
    """A server of the run, logging to `<run>/logs/vllm-[<node>-]<port>.log` (on SLURM several nodes may use one
    port), its scratch dir named for the run."""
    name = f"vllm-{node}-{spec.port}" if node else f"vllm-{spec.port}"
    return VllmServer(spec, log_path(run_dir, name), scratch_prefix(run_dir, "vllm"))


@contextlib.contextmanager
def serving(
    inf: InferenceConfig, run_dir: str | Path, servers: list[VllmServer], supervised: bool = False
) -> Iterator[list[PdRouter]]:
    """Start `servers` and, with prefill/decode, their pairs' routers (yielded); stop them all at the end. A second
    SIGTERM while they stop (the driver's death after its own SIGTERM) does not cut the stop short. `supervised`: a
    server killed while it starts is left to its supervisor (primerl.inference.server.start_side_by_side)."""
    routers = []
    try:
        start_side_by_side(servers, inf.startup_timeout_s, supervised)
        if inf.pd.enabled and inf.pd.role != PdRole.prefill:
            routers = start_routers(inf, run_dir, servers[0].spec.env)
        yield routers
    finally:
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main_thread else None
        try:
            for router in routers:
                router.stop()
            stop_side_by_side(servers)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
