"""Which run an inference server belongs to, so that no process of a run takes another run's server for its own.

A second run on the same address (the default `inference.port`, say) would otherwise pass every readiness check on
the first run's server: its orchestrator would read that server's policy version, sample from the first run's model
and pause it for its own weight loads. So every response of a primerl vLLM server carries `x-primerl-server: <id>`
(added by primerl.inference.guard from `PRIMERL_SERVER_ID`), the id is derived from the run directory, and the
launcher's readiness check and the orchestrator's health checks accept only their own run's id.
"""

import hashlib
from collections.abc import Mapping
from pathlib import Path

SERVER_ID_ENV = "PRIMERL_SERVER_ID"
SERVER_ID_HEADER = "x-primerl-server"


def server_identity(run_dir: str | Path) -> str:
    """The id of the run at `run_dir` (its resolved path: the same on every node of a shared filesystem)."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def served_by(headers: Mapping[str, str], identity: str | None) -> bool:
    """Whether a response with these headers came from the run whose id is `identity` (None: any server will do)."""
    return identity is None or headers.get(SERVER_ID_HEADER) == identity
