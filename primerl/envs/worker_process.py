"""One env worker process (primerl.envs.workers supervises N of them): a verifiers `EnvServer` in its own process and
process group, reached through verifiers' `EnvClient` (ZMQ, msgpack) on an ipc address; started, probed and killed
here.

The rollouts route: a worker answers a `run` request with the episode already turned into primerl's rollouts
(`episode_rollouts`, in the worker) as plain data, instead of verifiers' trace deltas and an episode record that the
orchestrator validates into pydantic models (`WireEpisode`) and then converts itself: the orchestrator's CPU per
single-turn rollout fell from ~1.7 to ~0.5 ms against stand-in servers, the worker's from ~6.3 to ~4.6 ms
(benchmarks/capacity.py). Only verifiers' `_run` is replaced (a worker serves primerl's orchestrator alone):
everything around it is verifiers' own handler, unchanged: the request id, the cancel of an abandoned run, the health
checks, a failed or malformed request and a reply that cannot be encoded answered as `success: false`.
"""

import asyncio
import base64
import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import verifiers.v1.serve.pool as verifiers_pool
from pydantic import Field
from verifiers.v1.serve import EnvClient, serve_env
from verifiers.v1.serve.server import EnvServer
from verifiers.v1.serve.types import BaseResponse, RunRequest

from primerl.envs.types import Rollout, RolloutFailure, ScoredBranch
from primerl.envs.verifiers_env import run_episode
from primerl.utils.liveness import Pulse
from primerl.utils.log import configure_logging, get_logger

log = get_logger(__name__)


def rollout_to_wire(rollout: Rollout | RolloutFailure) -> dict:
    """Plain data: a branch's routed experts as {"data": base64, "dtype", "shape"} (no pickles on the wire)."""
    if not isinstance(rollout, Rollout):
        return {"failure": rollout.reason}
    data = dataclasses.asdict(rollout)
    for branch in data["branches"]:
        if (routes := branch["routed_experts"]) is not None:
            encoded = base64.b64encode(np.ascontiguousarray(routes).tobytes()).decode("ascii")
            branch["routed_experts"] = {"data": encoded, "dtype": routes.dtype.str, "shape": list(routes.shape)}
    return data


def rollout_from_wire(data: dict) -> Rollout | RolloutFailure:
    if "failure" in data:
        return RolloutFailure(data["failure"])
    branches = []
    for branch in data["branches"]:
        if (routes := branch.get("routed_experts")) is not None:
            array = np.frombuffer(base64.b64decode(routes["data"]), dtype=np.dtype(routes["dtype"]))
            branch = {**branch, "routed_experts": array.reshape(routes["shape"])}
        branches.append(ScoredBranch(**branch))
    return Rollout(**{**data, "branches": branches})


class RolloutsResponse(BaseResponse):
    """A run's answer on the rollouts route: its rollouts as plain data (rollout_to_wire)."""

    rollouts: list[dict] = Field(default_factory=list)


class RolloutsServer(EnvServer):
    """verifiers' `EnvServer`, whose runs answer with rollouts (module docstring)."""

    async def _run(self, req: RunRequest, client_id: bytes, request_id: bytes) -> RolloutsResponse:
        (slot,) = self.env.slots(self._build_task(req.task_data))
        context = self._context(req.client, req.model, req.sampling)
        rollouts = await run_episode(self.env, slot, context, self._gate)
        return RolloutsResponse(rollouts=[rollout_to_wire(r) for r in rollouts])


class RolloutsReply:
    """The rollouts route's answer as msgpack gave it: verifiers' client reads only `success` and `error` of a reply
    (`EnvClient._request`), so nothing is validated into models."""

    def __init__(self, data: dict):
        self.success, self.error = bool(data.get("success")), data.get("error")
        self.rollouts = [rollout_from_wire(r) for r in data.get("rollouts") or []]

    @classmethod
    def model_validate(cls, data: dict) -> "RolloutsReply":
        return cls(data)


class WorkerClient(EnvClient):
    """verifiers' `EnvClient` with the rollouts route."""

    async def rollouts(self, ctx: Any, task_data: dict) -> list[Rollout | RolloutFailure]:
        """One rollout of the task whose dumped data is `task_data`, sampling with `ctx` (a `vf.ModelContext`).
        Raises `RuntimeError` with the worker's error for a request it could not run."""
        request = RunRequest(task_data=task_data, client=ctx.client, model=ctx.model, sampling=ctx.sampling)
        return (await self._request(request, RolloutsReply)).rollouts


def serve_worker(config_data: dict, address: str, death_pipe: Any) -> None:
    """A worker process's main: primerl's logging and client patches, then one verifiers `EnvServer`. Its own process
    group, so that killing a lost worker takes any tool servers it started with it."""
    from primerl.envs.http_transport import use_aiohttp_for_openai_clients
    from primerl.envs.pydantic_memo import memoize_default_factory_check

    os.setpgrp()
    configure_logging()
    memoize_default_factory_check()
    use_aiohttp_for_openai_clients()
    verifiers_pool.EnvServer = RolloutsServer  # what serve_env starts for one worker
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
