"""One env worker process (primerl.envs.workers supervises N of them): a verifiers `EnvServer` in its own process and
process group, reached through verifiers' `EnvClient` (ZMQ, msgpack) on an ipc address; started, probed and killed
here."""

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from verifiers.v1.episode import WireEpisode
from verifiers.v1.serve import EnvClient, serve_env

from primerl.utils.liveness import Pulse
from primerl.utils.log import configure_logging

INLINE_NODES = 16  # an episode of at most this many trace nodes is validated on the event loop (WorkerClient)


class WorkerClient(EnvClient):
    """verifiers' `EnvClient`, except that a small episode is validated on the event loop. verifiers hands every
    episode's validation to a thread (`asyncio.to_thread`, one at a time, so a long trace does not stall the loop);
    for a short one the hop (a task, a thread, the GIL passed back and forth) costs the orchestrator more than the
    validation itself: a single-turn episode (3 nodes) validates in ~0.36 ms, and validating it here took the
    orchestrator's CPU per rollout from ~2.0 to ~1.8 ms against stand-in servers (benchmarks/capacity.py, one worker).
    Upstream, verifiers could validate inline below a size, or in the receive loop's thread."""

    async def _validate_episode(self, record: dict) -> WireEpisode:
        if sum(len(trace["nodes"]) for trace in record["traces"]) <= INLINE_NODES:
            return WireEpisode.model_validate(record)
        return await super()._validate_episode(record)


def serve_worker(config_data: dict, address: str, death_pipe: Any) -> None:
    """A worker process's main: primerl's logging and client patches, then one verifiers `EnvServer`. Its own process
    group, so that killing a lost worker takes any tool servers it started with it."""
    from primerl.envs.http_transport import use_aiohttp_for_openai_clients
    from primerl.envs.pydantic_memo import memoize_default_factory_check

    os.setpgrp()
    configure_logging()
    memoize_default_factory_check()
    use_aiohttp_for_openai_clients()
    serve_env(max_workers=1, address=address, death_pipe=death_pipe, config_data=config_data)


@dataclass
class Worker:
    index: int
    process: Any  # multiprocessing.Process
    pipe: Any  # our end of its death pipe
    client: EnvClient
    gone: asyncio.Future  # its result is why the worker was lost
    live: bool = False
    outstanding: int = 0
    pulse: Pulse = field(default_factory=Pulse)  # its signs of life; `pulse.finished` counts the rollouts it answered
    started: float = field(default_factory=time.monotonic)

    @property
    def served(self) -> int:
        return self.pulse.finished


def start_worker(mp_context: Any, folder: str, config_data: dict, index: int, incarnation: int) -> Worker:
    """Start worker `index` (its `incarnation`-th process) on a fresh ipc address in `folder`."""
    address = f"ipc://{folder}/{index}-{incarnation}"
    ours, theirs = mp_context.Pipe()
    process = mp_context.Process(
        target=serve_worker, args=(config_data, address, theirs), name=f"env-worker-{index}", daemon=False
    )
    process.start()
    theirs.close()  # the worker holds the other end; our close (or death) is its EOF
    return Worker(index, process, ours, WorkerClient(address), asyncio.get_running_loop().create_future())


async def first_health_answer(worker: Worker, timeout: float) -> bool:
    """Whether a starting worker answers a health check within `timeout` (it answers nothing until it has bound its
    address: ask again)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await worker.client.health(timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return True
        except Exception:  # a malformed or failed answer counts as none
            pass
        if time.monotonic() >= deadline:
            return False


async def health_check(worker: Worker, timeout: float) -> None:
    """One health check of a live worker; an answer resets its silence."""
    with contextlib.suppress(Exception):  # no answer in time, or a malformed one, counts as none
        if await worker.client.health(timeout=timeout):
            worker.pulse.answered()


async def stop_worker(worker: Worker, reason: str) -> None:
    """Kill `worker` (its process group), fail its rollouts with `reason`, free its socket."""
    worker.live = False
    if not worker.gone.done():
        worker.gone.set_result(reason)
    if worker.process.is_alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.kill()
    await asyncio.to_thread(worker.process.join, 10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker.process.pid, signal.SIGKILL)  # what it started and left behind
    worker.pipe.close()
    await asyncio.sleep(0)  # its rollouts see `gone` and cancel their requests before the socket goes
    with contextlib.suppress(Exception):
        await asyncio.wait_for(worker.client.close(), 5)


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
