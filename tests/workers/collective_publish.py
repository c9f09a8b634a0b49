"""Under torchrun: `BASE OUT EP` builds primerl's Trainer on the model at BASE (EP: expert parallel degree, 1 for a
dense model), moves every weight by one AdamW step, then publishes that policy twice: as files (version 1 under
OUT/run, Trainer.export) and by collective (version 2, primerl.trainer.publish). Rank 0 also plays the inference
side of the collective in a thread: it answers the offer with one group of one worker, receives the tensors with
`WeightReceiver` and writes them to OUT/received-<world>.safetensors; OUT/publish-<world>.json holds both
fingerprints, the offer's bucket count and the largest bucket in bytes."""

import json
import sys
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file

from primerl.config.trainer import OptimConfig, TrainerConfig
from primerl.config.weights import WeightsConfig, WeightTransport
from primerl.trainer.dist import close_distributed, init_distributed
from primerl.trainer.publish import Publisher
from primerl.trainer.trainer import Trainer
from primerl.transport.atomic import is_stable
from primerl.transport.offer import read_offer
from primerl.transport.receiver import WeightReceiver
from primerl.transport.run_dir import weights_path
from primerl.transport.weights import answer_offer, published_fingerprint
from primerl.utils.wait import wait_until

BUCKET_MB = 1  # the tiny models are a few MiB: several buckets


def move_every_weight(trainer: Trainer) -> None:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(trainer.info.rank))
    micro = {"input_ids": ids, "position_ids": torch.arange(16).expand_as(ids).contiguous()}
    trainer.step(0, [micro], lambda scores, _: (scores.logprobs.mean() / trainer.info.world_size, {}))


def play_inference_worker(path: Path, out: Path) -> None:
    """What the orchestrator and one vLLM worker do with an offer: answer it, then receive it."""
    wait_until(lambda: is_stable(path), f"the offer at {path}")
    offer = read_offer(path)
    answer_offer(path, offer.id, {"r0-test": 2})
    received = dict(WeightReceiver().tensors(offer, "r0-test", 1, 2, torch.device("cpu")))
    save_file({name: tensor.clone() for name, tensor in received.items()}, out)
    sizes = [sum(spec.nbytes for spec in bucket) for bucket in offer.buckets]
    (out.with_suffix(".buckets.json")).write_text(json.dumps(sizes))


def main(base: str, out_dir: str, ep: int) -> None:
    info = init_distributed("gloo")
    out, run = Path(out_dir), Path(out_dir) / "run"
    trainer = Trainer.build(
        base, info, OptimConfig(lr=1e-2), TrainerConfig(logprob_chunk_size=16), ep=ep, export_dtype="bfloat16"
    )
    move_every_weight(trainer)
    cfg = WeightsConfig(transport=WeightTransport.collective, bucket_mb=BUCKET_MB, timeout_s=60)
    publisher = Publisher(trainer, run, cfg, last_version=10, under_slurm=False)
    trainer.export(weights_path(run, 1))  # the files to compare with
    received = out / f"received-{info.world_size}.safetensors"
    inference = threading.Thread(target=play_inference_worker, args=(weights_path(run, 2), received))
    if info.is_main:
        inference.start()
    sent = publisher.publish(2, keep=None)
    if info.is_main:
        inference.join()
        record = {
            "file_fingerprint": published_fingerprint(weights_path(run, 1)),
            "sent_fingerprint": sent,
            "published_fingerprint": published_fingerprint(weights_path(run, 2)),
            "bucket_bytes": json.loads(received.with_suffix(".buckets.json").read_text()),
        }
        (out / f"publish-{info.world_size}.json").write_text(json.dumps(record))
    close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
