"""Operating-system helpers every process may need: stopping process groups, picking a free port, telling loopback."""

import ipaddress
import os
import random
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

STOP_GRACE_S = 20.0
"""How long the driver waits after SIGTERM before it SIGKILLs its children's process groups."""
NESTED_GRACE_S = STOP_GRACE_S / 2
"""How long a child waits for the process groups it started itself (the inference wrapper's vLLM servers) before it
SIGKILLs them. Shorter than its parent's grace: a parent's SIGKILL that lands first reaches only the child's own
group, and grandchildren that lead groups of their own would be left with the parent-death SIGTERM they already had
(seen: a vLLM server whose uvicorn waited on a request of its dead engine outlived the run by a minute)."""


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit and return it: the orchestrator holds a
    connection per replica during a weight load's fan-out (1,024 replicas need more than the common soft 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # kept as it is: the fan-out's connections count against it
    return soft


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (`localhost` or an address in 127.0.0.0/8 or ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost
        return False


def exit_reason(code: int | None) -> str:
    """A process's end in words: the signal that killed it (a negative exit code), or its exit code."""
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10000


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port that is free now, with the `count - 1` ports after it free too (replicas on consecutive ports). Picked
    below the kernel's ephemeral range where it is known: a port from that range can be handed to any process's
    outgoing connection or port-0 bind (vLLM's internal sockets, another test's pick) before our server binds it,
    which once made a run refuse its own prefill/decode port as taken."""
    low, high = _unassigned_range()
    rng = random.Random()
    for _ in range(200 if high - low >= count else 0):
        first = rng.randint(low, high - count + 1)
        if all(_bindable(host, first + i) for i in range(count)):
            return first
    while True:  # the ephemeral range unknown, or nothing free below it: the kernel's pick
        with socket.socket() as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        if first + count - 1 <= 65535 and all(_bindable(host, first + i) for i in range(1, count)):
            return first


def _unassigned_range() -> tuple[int, int]:
    """Ports the kernel never assigns on its own: from LOWEST_PICKED_PORT to below its ephemeral range; (0, 0) when
    that range is unknown or leaves no room."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (LOWEST_PICKED_PORT, ephemeral_low - 1) if ephemeral_low - 1 > LOWEST_PICKED_PORT else (0, 0)


def _bindable(host: str, port: int, reuse_address: bool = False) -> bool:
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on `host:port` now. With SO_REUSEADDR, as servers bind: connections of a stopped
    server still in TIME_WAIT do not count, since they do not keep a new server from binding."""
    return not _bindable(host, port, reuse_address=True)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each live process's group, wait up to `grace_s` in all, then SIGKILL every group: grandchildren
    (vLLM's engine core, torchrun's ranks) may outlive their parent's exit. Each process must lead its own group
    (started with `start_new_session=True`)."""
    alive = [p for p in processes if p.poll() is None]
    for process in alive:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in alive:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        _signal_group(process, signal.SIGKILL)
        process.wait()
