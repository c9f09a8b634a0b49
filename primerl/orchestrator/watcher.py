"""Watcher: follows the trainer's published policies into the inference server, and the server's health.

Every `poll_s` it looks for a newer STABLE weights directory; when there is one it loads the newest into the server
in flight (pause with requests kept, load, resume: primerl.orchestrator.inference_client), then advances `Policy`
and calls `on_change` (the orchestrator re-checks its batch cut and wakes the dispatcher). Versions in between are
skipped: the server only ever needs the newest.

Health: when the server does not answer (a failed load, or `check_health()` asked by the orchestrator after a group
whose every rollout failed), admission stops (`serving` false), the watcher waits for the server with back-off, and a
server that came back serving another version (a restart serves the start weights) gets the current policy again.
Rollouts that failed meanwhile are counted failures; no step is skipped.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from primerl.orchestrator.inference_client import InferenceClient
from primerl.orchestrator.types import Policy
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import latest_stable_version
from primerl.utils.log import get_logger

log = get_logger(__name__)
HEALTH_EVERY_S = 5.0


class Watcher:
    def __init__(self, run_dir: Path, client: InferenceClient, policy: Policy, poll_s: float,
                 recovery_timeout_s: float, on_change: Callable[[], None] = lambda: None,
                 before_load: Callable[[int], Awaitable[None]] | None = None):  # fmt: skip
        self.run_dir, self.client, self.policy = run_dir, client, policy
        self.poll_s, self.recovery_timeout_s, self.on_change = poll_s, recovery_timeout_s, on_change
        self.before_load = before_load  # awaited with the served version before a newer one is loaded (online evals)
        self.serving = True  # false while the server is down: the orchestrator admits nothing
        self.load_s = 0.0  # seconds spent loading weights, cumulative
        self.loads = 0
        self.recoveries = 0
        self._suspect = asyncio.Event()

    def check_health(self) -> None:
        """Ask for a health check at the next poll (e.g. after a group whose rollouts all failed)."""
        self._suspect.set()

    async def run(self) -> None:
        last_health = time.monotonic()
        while True:
            try:
                if self._suspect.is_set() or time.monotonic() - last_health > HEALTH_EVERY_S:
                    self._suspect.clear()
                    last_health = time.monotonic()
                    if not await self.client.healthy():
                        await self.recover()
                await self.update()
            except (httpx.HTTPError, RuntimeError) as err:
                log.warning("weight update failed (%s: %s); checking the server", type(err).__name__, err)
                await self.recover()
            try:
                await asyncio.wait_for(self._suspect.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def update(self) -> None:
        """Load the newest published policy if it is newer than the one served."""
        latest = latest_stable_version(self.run_dir)
        if latest is None or latest <= self.policy.version:
            return
        if self.before_load is not None:
            await self.before_load(self.policy.version)
            latest = latest_stable_version(self.run_dir) or latest  # the trainer may have published more meanwhile
        await self._load(latest)

    async def _load(self, version: int) -> None:
        seconds = await self.client.load_weights(weights_path(self.run_dir, version), version)
        log.info("policy v%d -> v%d loaded in flight in %.2fs", self.policy.version, version, seconds)
        self.policy.version = version
        self.load_s += seconds
        self.loads += 1
        self.on_change()

    async def recover(self) -> None:
        """Wait for the server, then make it serve the current policy again."""
        self.serving = False
        log.warning("inference server %s unreachable; waiting with back-off", self.client.base_url)
        await self.client.wait_healthy(self.recovery_timeout_s)
        served = await self.client.policy_version()
        latest = latest_stable_version(self.run_dir) or 0  # a restarted server serves the start weights, v0
        if latest > 0 and served != latest:
            log.warning("the server serves policy v%d, not v%d: reloading", served, latest)
            await self._load(latest)
        else:
            self.policy.version = served
        self.recoveries += 1
        self.serving = True
        log.info("inference server %s is back", self.client.base_url)
        self.on_change()
