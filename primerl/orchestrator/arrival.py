"""How a policy version gets into the replicas, for the watcher (primerl.orchestrator.watcher): the answer to a
collective offer, and the proof by fingerprint that a replica serves what the trainer published.

An offer's answer names the groups of the replicas that will take it; the first answer in place stands
(primerl.transport.weights.answer_offer), so one the trainer withdrew is taken by nobody. A load's fingerprint that
differs from the trainer's is logged with both values and, for a version in files, loaded once more (an offer cannot
be sent twice); still different, the replica goes to the watcher's `fail`.
"""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from primerl.orchestrator.inference_client import InferenceClient, Loaded
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import (
    OFFER_FILE,
    RECEIVERS_FILE,
    answer_offer,
    is_offer,
    published_fingerprint,
    read_json_file,
)
from primerl.utils.log import get_logger

log = get_logger(__name__)


class Arrival:
    def __init__(self, run_dir: Path, clients: list[InferenceClient], transfer_timeout_s: float):
        self.run_dir, self.clients = run_dir, clients
        self.transfer_timeout_s = transfer_timeout_s  # weights.timeout_s: how long a sent offer's fingerprint may lag
        self.mismatches = 0  # loads whose fingerprint differed from the trainer's, cumulative

    def answered(self, version: int) -> bool:
        """Whether offer `version` has its answer."""
        path = weights_path(self.run_dir, version)
        offer, answer = read_json_file(path / OFFER_FILE), read_json_file(path / RECEIVERS_FILE)
        return offer is not None and answer is not None and answer["offer"] == offer["id"]

    async def answer(self, version: int, targets: list[int], fail: Callable[[int, str], None]) -> dict[int, str]:
        """Answer offer `version` with the groups of `targets` (those whose group cannot be named are left out and
        given to `fail`), unless the trainer withdrew it first. Returns replica -> group name, of the answer that
        stands. No `targets`: the answer that nobody takes it; targets none of which can be named: no answer."""
        path = weights_path(self.run_dir, version)
        named = await asyncio.gather(*(self.clients[i].collective_group(i) for i in targets), return_exceptions=True)
        groups = {}
        for index, result in zip(targets, named, strict=True):
            if isinstance(result, BaseException):
                fail(index, f"its collective group for v{version} could not be named ({type(result).__name__})")
            else:
                groups[index] = result
        if targets and not groups:
            return {}  # unanswered still: the trainer waits until a replica is back to take it
        standing = answer_offer(path, read_json_file(path / OFFER_FILE)["id"], dict(groups.values()))
        if groups and not standing:
            log.info("v%d was withdrawn by the trainer (no rollout can use it any more)", version)
        return {index: name for index, (name, _) in groups.items() if name in standing}

    async def expected(self, path: Path) -> str | None:
        """The trainer's fingerprint of the version at `path`; a sent offer's is written once the last bucket left,
        so it is waited for (at most `transfer_timeout_s`). None: an adapter, or a directory from before
        fingerprints."""
        if not is_offer(path):
            return published_fingerprint(path)
        deadline = time.monotonic() + self.transfer_timeout_s
        while (found := published_fingerprint(path)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return found

    async def proven(
        self,
        index: int,
        version: int,
        loaded: Loaded,
        expected: str | None,
        resend: bool,
        fail: Callable[[int, str], None],
    ) -> bool:
        """Whether replica `index` serves the trainer's weights (`expected`) after its load: a mismatch is logged
        with both values and, for a file, loaded once more; still different, it goes to `fail`."""
        if expected is None or loaded.fingerprint == expected:
            return True
        self.mismatches += 1
        client = self.clients[index]
        log.warning(
            "inference server %s serves fingerprint %s after loading v%d, not the trainer's %s%s",
            client.base_url,
            loaded.fingerprint,
            version,
            expected,
            ": loading it again" if resend else "",
        )
        if resend:
            again = await client.load_weights(weights_path(self.run_dir, version), version)
            if again.fingerprint == expected:
                return True
            self.mismatches += 1
        fail(index, f"it serves fingerprint {loaded.fingerprint}, not v{version}'s {expected}")
        return False
