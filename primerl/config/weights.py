"""Weights group: how a new policy travels from the trainer to the inference workers (primerl.transport.collective)."""

from dataclasses import dataclass
from enum import Enum

from primerl.utils.bounds import bounded


class WeightTransport(Enum):
    filesystem = "filesystem"  # each version a safetensors directory under <run>/weights, read by every server
    collective = "collective"  # each version sent from trainer rank 0 to every worker (gloo on CPU, NCCL on GPU)


@dataclass
class WeightsConfig:
    transport: WeightTransport = WeightTransport.filesystem
    # collective: tensors travel in buckets of at most this many MiB of one dtype (a larger tensor goes alone); the
    # trainer gathers one bucket at a time, so no rank ever holds the whole model unsharded
    bucket_mb: int = bounded(256, ge=1)
    # collective: joining a replica's group, and each bucket, must finish within this; past it the side that waits
    # fails with one line naming the bucket, and the orchestrator takes that replica out and brings it back
    timeout_s: float = bounded(300.0, gt=0)
    # collective: the interface trainer rank 0's gloo binds for the transfers (the workers join through a file in the
    # run's weights directory); None: this node's loopback address locally, its host name under SLURM
    host: str | None = None
    # collective: send each version to the replicas that proved the previous one as the values that changed
    # (primerl.transport.delta; ~6x fewer bytes at the ~10% of bf16 values an RL step changes). Costs one more copy
    # of the model in host memory on trainer rank 0 and on every inference worker
    delta: bool = False
    # collective: trainer rank 0 sends each bucket into one replica's group, and the replicas pass it on in a chain
    # (primerl.transport.relay): its egress is the model once (twice when some replicas take deltas and others not)
    # whatever the number of replicas, at a bucket's time per replica in latency. Costs one more copy of the model in
    # host memory on trainer rank 0 during a transfer
    relay: bool = False
