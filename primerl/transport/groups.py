"""Process groups for the collective weights (primerl.transport.collective, primerl.transport.receiver): joining one
through the run's FileStore, with a time limit on every operation, and the options of the operations they run.
gloo on CPU, NCCL on GPU: the same calls."""

import datetime

import torch
import torch.distributed as dist

from primerl.utils.process import is_loopback


class TransferError(RuntimeError):
    """A collective weight transfer that failed or stalled past `weights.timeout_s`."""


def _options(backend: str, timeout_s: float, host: str):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # on loopback both sides bind 127.0.0.1; across nodes each binds the interface its host name resolves to
    loopback = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if is_loopback(host) else None
    options._devices = [loopback or dist.ProcessGroupGloo.create_default_device()]
    return options


def join_group(
    store: dist.Store, name: str, rank: int, world: int, backend: str, timeout_s: float, host: str
) -> dist.ProcessGroup:
    """This process's member of group `name` (blocks until all `world` members joined, at most `timeout_s`)."""
    prefixed = dist.PrefixStore(f"primerl/{name}", store)
    options = _options(backend, timeout_s, host)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    return dist.ProcessGroupGloo(prefixed, rank, world, options)


def from_rank(root: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = root
    return options


def least() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options


def as_hex(fingerprint: torch.Tensor) -> str:
    return bytes(fingerprint.cpu().tolist()).hex()


def first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
