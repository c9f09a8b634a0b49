"""Publishing policy version v for the inference servers, by `weights.transport`.

- `filesystem`: the full weights as an HF directory `<run>/weights/step_v` (Trainer.export), read by every server.
- `collective`: the same directory holds an offer (primerl.transport.collective) and, once sent, the fingerprint;
  the weights go from trainer rank 0 to every worker of every replica the orchestrator names. The last version of
  the run goes to the filesystem whatever the transport: it is the run's product (eval, the ledger, a fork read it),
  and the orchestrator's last load (the final online eval) reads it there.

Every rank calls `publish` (gathers are collective). Each rank waits for the orchestrator's answer to an offer by
reading the run directory, as it waits for batches, so no rank blocks in a collective while rank 0 waits. An offer
made after the orchestrator wrote its last batch (it answers no more) is withdrawn by rank 0: the first answer in
place stands (primerl.transport.weights.answer_offer), so a withdrawal and a late answer cannot both act.
"""

import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from primerl.config.weights import WeightsConfig, WeightTransport
from primerl.trainer.trainer import Trainer
from primerl.trainer.weights import export_specs, export_stream
from primerl.transport.atomic import is_stable, remove_published, stable_steps
from primerl.transport.collective import WeightSender
from primerl.transport.offer import Offer, in_buckets, plan_buckets, publish_offer, read_offer
from primerl.transport.run_dir import weights_path, weights_root
from primerl.transport.weights import (
    RECEIVERS_FILE,
    answer_offer,
    drop_old_version,
    is_offer,
    published_fingerprint,
    read_json_file,
    rendezvous_dir,
    write_fingerprint,
)
from primerl.utils.log import get_logger
from primerl.utils.process import is_loopback
from primerl.utils.wait import wait_until

log = get_logger("trainer")


def sender_host(cfg: WeightsConfig, under_slurm: bool) -> str:
    """The interface trainer rank 0's gloo binds for the transfers: `weights.host`, else loopback locally and this
    node's name under SLURM (the workers run on other nodes)."""
    return cfg.host or (socket.gethostname() if under_slurm else "127.0.0.1")


class Publisher:
    def __init__(
        self,
        trainer: Trainer,
        run_dir: Path,
        cfg: WeightsConfig,
        last_version: int,
        under_slurm: bool,
        orchestrator_done: Callable[[], bool] = lambda: False,
    ):
        """`last_version`: the run's last, published as files. `orchestrator_done`: whether the orchestrator has
        written its last batch (then no offer will be answered)."""
        self.trainer, self.run_dir, self.cfg, self.last_version = trainer, run_dir, cfg, last_version
        self.orchestrator_done = orchestrator_done
        self.sender = None
        if cfg.transport == WeightTransport.collective and trainer.info.is_main:
            backend = "nccl" if trainer.info.device.type == "cuda" else "gloo"
            host = sender_host(cfg, under_slurm)
            self.sender = WeightSender(host, rendezvous_dir(run_dir), backend, cfg.timeout_s, cfg.delta, cfg.relay)
            where = "loopback" if is_loopback(host) else host
            log.info(f"collective weights: rendezvous in {self.sender.address} ({backend}, {where})")

    def republish(self, version: int) -> None:
        """Collective, at a resume: publish `version` again unless its full weights are there. An offer left by the
        trainer before is withdrawn first (its sender is gone; the servers may have restarted since), and so is any
        offer of a later version (a resume from a checkpoint before the newest, which was damaged: no sender will
        ever send it, and the orchestrator would wait on it rather than take this one)."""
        path = weights_path(self.run_dir, version)
        if self.trainer.info.is_main:
            for later in stable_steps(weights_root(self.run_dir)):
                if later > version and is_offer(weights_path(self.run_dir, later)):
                    log.warning(f"v{later}: withdrawn (offered by a trainer before this one, past its checkpoint)")
                    remove_published(weights_path(self.run_dir, later))
        if is_stable(path) and not is_offer(path):
            return
        if self.trainer.info.is_main:
            remove_published(path)
        dist.barrier()
        self.publish(version, keep=None)  # the next publish drops what is no longer needed

    def publish(self, version: int, keep: int | None) -> str | None:
        """Collective: publish `version`; with `keep`, drop the version no server can need any more
        (primerl.transport.weights.versions_to_keep). Returns its fingerprint on rank 0 (None elsewhere, and for
        an adapter)."""
        path = weights_path(self.run_dir, version)
        if self.cfg.transport == WeightTransport.filesystem or version >= self.last_version:
            self.trainer.export(path)
            fingerprint = published_fingerprint(path) if self.trainer.info.is_main else None
        else:
            fingerprint = self._send(version, path)
        if keep is not None and self.trainer.info.is_main:
            drop_old_version(self.run_dir, version, keep)
        return fingerprint

    def _send(self, version: int, path: Path) -> str | None:
        """Offer `version`, wait for the orchestrator's answer, gather and send it bucket by bucket."""
        dtype = self.trainer.export_dtype
        stream = export_stream(self.trainer.model, dtype)
        if self.sender is None:  # every rank gathers each parameter in turn, in the order the offer announced
            wait_until(lambda: is_stable(path), f"rank 0's offer of v{version} ({path})", note_every_s=60)
            offer = read_offer(path)
            self._answer(offer, path)
            for _ in in_buckets(offer, stream):
                pass
            return None
        offer = self.sender.offer(
            version, plan_buckets(export_specs(self.trainer.model, dtype), self.cfg.bucket_mb << 20)
        )
        publish_offer(path, offer)
        groups = self._answer(offer, path)
        started = time.perf_counter()
        fingerprint = self.sender.transfer(offer, groups, stream)
        write_fingerprint(path, fingerprint)
        if self.sender.groups:
            sent = sum(self.sender.egress.values())
            took = len(self.sender.delta_takers & set(self.sender.groups))
            deltas = f", deltas to {took}" if offer.delta else ""
            log.info(
                f"v{version} sent to {len(self.sender.groups)} replica group(s) in "
                f"{time.perf_counter() - started:.2f}s ({len(offer.buckets)} bucket(s), {sent / 2**20:.1f} MiB{deltas})"
            )
        else:
            log.info(f"v{version} went to no replica (each serves it already, or no rollout can use it any more)")
        return fingerprint

    def _answer(self, offer: Offer, path: Path) -> dict[str, int]:
        """The orchestrator's answer to `offer`: the replica groups that take it (name -> members). Once the
        orchestrator has written its last batch no rollout can use the version: rank 0 withdraws the offer (an
        answer of no groups), unless the orchestrator's answer came first."""

        def answered() -> bool:
            found = read_json_file(path / RECEIVERS_FILE)
            if found is not None and found["offer"] == offer.id:
                return True
            if self.sender is not None and self.orchestrator_done():
                answer_offer(path, offer.id, {})
                return True
            return False

        what = f"the orchestrator to take v{offer.version} ({path / RECEIVERS_FILE})"
        wait_until(answered, what, poll_s=0.05, max_poll_s=0.5, note_every_s=60)
        return {str(name): int(world) for name, world in read_json_file(path / RECEIVERS_FILE)["groups"].items()}
