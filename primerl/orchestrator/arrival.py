"""How a policy version gets into the replicas, for the watcher (primerl.orchestrator.watcher): the answer to a
collective offer, and what follows a load that was not proven.

An offer's answer names the groups of the replicas that will take it; the first answer in place stands
(primerl.transport.weights.answer_offer), so one the trainer withdrew is taken by nobody. An offer whose sender is
gone (its rendezvous file removed by the trainer after it) is not answered: that trainer withdraws it. A load that its workers
could not prove (their fingerprint is not the trainer's: primerl.inference.worker_extension) left its server paused;
it is logged with both values and, for a version in files, loaded once more (an offer cannot be sent twice); still
not proven, the replica goes to the watcher's `fail`, paused, and its recovery loads it anew.
"""

import asyncio
from collections.abc import Callable
from pathlib import Path

from primerl.orchestrator.inference_client import InferenceClient, Loaded, NotProven
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import OFFER_FILE, RECEIVERS_FILE, answer_offer, read_json_file
from primerl.utils.log import get_logger

log = get_logger(__name__)


class Arrival:
    def __init__(self, run_dir: Path, clients: list[InferenceClient], transfer_timeout_s: float):
        self.run_dir, self.clients = run_dir, clients
        self.transfer_timeout_s = transfer_timeout_s  # weights.timeout_s: how long a sent offer's fingerprint may lag
        self.mismatches = 0  # loads whose fingerprint differed from the trainer's, cumulative
        self.gone: set[int] = set()  # offers whose sender was gone when an answer was due (logged once each)

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
        store = Path(read_json_file(path / OFFER_FILE)["store"])
        if not store.is_file():  # its trainer is gone: the one after it withdraws this offer and offers its own
            if version not in self.gone:
                self.gone.add(version)
                log.warning(
                    "v%d was offered by a trainer that is gone (no %s); waiting for its successor", version, store
                )
            return {}
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

    async def prove_again(
        self, index: int, version: int, refused: NotProven, resend: bool, fail: Callable[[int, str], None]
    ) -> Loaded | None:
        """Replica `index` could not prove its load of `version` (`refused`): a version in files (`resend`) is loaded
        once more; the load, or None once the replica went to `fail`."""
        self.mismatches += 1
        log.warning("%s%s", refused, "; loading it again" if resend else "")
        if resend:
            try:
                return await self.clients[index].load_weights(weights_path(self.run_dir, version), version)
            except NotProven as again:
                self.mismatches += 1
                refused = again
        fail(index, str(refused))
        return None
