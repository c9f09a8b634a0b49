"""Process-group and FSDP2 set-up shared by every training entry point (SFT and RL).

Runs the same under `torchrun --nproc-per-node N` and as a plain single process (world size 1, own rendezvous).
Backend `auto` is NCCL when CUDA is present and gloo on CPU.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from primerl.utils.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str = "auto") -> DistInfo:
    # plain `python -m ...`: a world of one, rendezvous in memory. (A TCP store would listen on every interface:
    # torch's TCPStore has no bind address.)
    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if alone:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def main_rank_first(info: DistInfo, build: Callable[[], T]) -> T:
    """Run `build` (e.g. building or downloading a model) on rank 0 first, then on the others, which then find its
    result cached: ranks never build the same files at once."""
    result = build() if info.is_main else None
    if dist.is_initialized():
        dist.barrier()
    return result if info.is_main else build()


def data_mesh(info: DistInfo, dp_shard: int) -> DeviceMesh:
    return init_device_mesh(info.device.type, (dp_shard,), mesh_dim_names=("dp_shard",))


def mixed_precision(precision: str, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's policy for `trainer.precision`: fp32 computes in the parameters' dtype (fp32); bf16 all-gathers and
    computes in bf16 and reduce-scatters gradients in fp32 (gloo cannot reduce bf16; nothing is reduced in bf16
    anyway), into the fp32 master weights that AdamW updates."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("trainer.precision", f"bf16 is not supported by {torch.cuda.get_device_name(device)}")
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(
    model: torch.nn.Module, mesh: DeviceMesh, ep: int = 1, mp_policy: MixedPrecisionPolicy | None = None
) -> set[torch.nn.Parameter]:
    """FSDP2: each decoder layer is its own unit (all-gathered just in time), the rest is the root unit.

    With ep > 1 the MoE experts are first sharded over the same mesh by expert (primerl.trainer.expert_parallel)
    and kept out of FSDP; returns those expert parameters (empty without EP)."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    experts: set[torch.nn.Parameter] = set()
    if ep > 1:
        from primerl.trainer.expert_parallel import apply_expert_parallel

        if ep != mesh.size():
            raise ValueError(f"expert parallel needs ep == the FSDP mesh size, got ep={ep}, mesh={mesh.size()}")
        experts = apply_expert_parallel(model, mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=experts or None, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, ignored_params=experts or None, mp_policy=mp_policy)
    return experts


MAX_SUFFIX = "_max"  # a sum whose key ends so is a maximum: reduced with max, over micro-batches and ranks


def all_reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Collective: each value summed over ranks, in one all-reduce (every rank passes the same keys); a value whose
    key ends in MAX_SUFFIX is the maximum over ranks instead (one more all-reduce when there are any)."""
    reduced = {}
    for keys, op in (
        (sorted(k for k in values if not k.endswith(MAX_SUFFIX)), dist.ReduceOp.SUM),
        (sorted(k for k in values if k.endswith(MAX_SUFFIX)), dist.ReduceOp.MAX),
    ):
        if keys:
            tensor = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
            dist.all_reduce(tensor, op=op)
            reduced |= dict(zip(keys, tensor.tolist()))
    return reduced


def all_reduce_sum(value: float | int, device: torch.device) -> float:
    return all_reduce_sums({"value": value}, device)["value"]


def close_distributed(synchronize: bool = True) -> None:
    """Tear the process groups down. After work that ended well on every rank, first wait for every rank
    (`synchronize`): a rank that destroys its groups while another still works with them can abort in gloo's threads
    ("terminate called without an active exception", SIGABRT: seen once in CI, rank 1 of a 2-rank collective publish
    exiting while rank 0 still sent). After a failure, no wait: a rank that raised would hold the others in it."""
    if dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
