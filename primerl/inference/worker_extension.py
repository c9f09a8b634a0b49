"""Methods added to every vLLM worker (`--worker-extension-cls`) for in-place weight loads.

Called through vLLM's `/collective_rpc` (dev mode; primerl.inference.guard lets only `primerl_*` methods through).
Only string arguments cross the wire. Weights are read with safetensors (never a pickle), only from a directory the
rule of primerl.transport.weights.weights_dir_refusal allows (STABLE, below the run's own weights directory
`WEIGHTS_DIR_ENV`, no symlink out of it): anything else is refused and logged. A
directory holding a collective offer (primerl.transport.collective) is received from trainer rank 0 instead, in the
process group the orchestrator names.

With `weights.delta` a worker keeps the last version it proved by collective, to rebuild the next from the changed
values alone (primerl.transport.receiver); any other load spends it.

A load proves itself (primerl.transport.fingerprint): the worker fingerprints every byte it loads (reading back from
the model each tensor it keeps in checkpoint layout) and compares it with the trainer's fingerprint in the version's
directory (a collective offer's is written once its last bucket left: awaited up to the offer's timeout). It answers
JSON: the version it now serves and the fingerprint; when the two differ, or the trainer's is missing, it serves no
known version (`UNPROVEN`) and says so, and the orchestrator keeps the server paused (primerl.orchestrator.
inference_client). An adapter's proof is its files' tensors, as the server was pointed at them.
"""

import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from primerl.transport.fingerprint import Fingerprint, tensor_digest
from primerl.transport.offer import read_offer
from primerl.transport.receiver import WeightReceiver
from primerl.transport.weights import (
    UNPROVEN,
    WEIGHTS_DIR_ENV,
    awaited_fingerprint,
    is_adapter,
    is_offer,
    store_refusal,
    weights_dir_refusal,
)
from primerl.utils.failpoints import failpoint

log = logging.getLogger(__name__)
IDLE_SPIN_ENV = "PRIMERL_VLLM_IDLE_SPIN_S"  # set by primerl.inference.vllm_args from inference.cpu_idle_spin_s
# "0,1": the cores a CPU server's engine-core process runs its model on (inference.cpu_executor=uni; vllm_args)
ENGINE_CORES_ENV = "PRIMERL_VLLM_ENGINE_CORES"


def shorten_idle_spin(busy_loop_s: float) -> bool:
    """Cap how long this worker's shared-memory queue readers busy-wait after their last message (vLLM 0.32:
    `SpinCondition.busy_loop_s`, 1 s, then a socket poll that a writer's notify wakes). Returns whether it applied:
    a vLLM without that class keeps its own behaviour, with a warning."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        SpinCondition = None
    if SpinCondition is None or not hasattr(SpinCondition, "wait"):
        log.warning("primerl: this vLLM has no SpinCondition; %s is ignored", IDLE_SPIN_ENV)
        return False
    original = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        if self.is_reader and self.busy_loop_s > busy_loop_s:
            self.busy_loop_s = busy_loop_s
        return original(self, timeout_ms)

    SpinCondition.wait = wait
    return True


def pin_engine_thread(cores: str) -> None:
    """Run this thread, and the OpenMP threads torch starts from it later, on `cores` ("0,1"): what vLLM's worker
    process gets from VLLM_CPU_OMP_THREADS_BIND, for a model run in the engine-core process, whose main thread
    creates the worker (and imports this module). The engine's socket threads, started earlier, stay unpinned."""
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})  # 0: the calling thread
    log.info("primerl: the engine runs its model on cores %s", cores)


if os.environ.get(IDLE_SPIN_ENV):  # imported by vLLM in each worker process (--worker-extension-cls)
    shorten_idle_spin(float(os.environ[IDLE_SPIN_ENV]))
if os.environ.get(ENGINE_CORES_ENV):
    pin_engine_thread(os.environ[ENGINE_CORES_ENV])


def _killed_after_the_first(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, tensor
        os.kill(os.getpid(), signal.SIGKILL)


class PrimerlWorkerExtension:
    primerl_policy_version: int = 0
    _primerl_receiver: WeightReceiver | None = None

    def primerl_load_weights(self, path: str, version: str, group: str = "") -> str:
        """Load the version in `path` (a collective offer: received in `group`) and prove it; answers JSON {version,
        fingerprint, expected} (module docstring). Failpoints (primerl.utils.failpoints): `worker.keep_old_weights`
        takes the tensors but loads none (a silent no-op load); `worker.die_mid_transfer` kills this worker once a
        collective transfer began."""
        refusal = weights_dir_refusal(path, os.environ.get(WEIGHTS_DIR_ENV))
        if refusal is not None:
            log.warning("primerl: refused to load weights from %s: %s", path, refusal)
            raise PermissionError(f"refused: {refusal}")
        folder = Path(path)
        version_number = int(version)  # a bad version fails here, before any weight is touched
        self.primerl_policy_version = UNPROVEN  # until this load is proven
        if is_adapter(folder):
            # a LoRA policy: the engine's LoRA manager has loaded the adapter (/v1/load_lora_adapter, which the
            # guard holds to the same directory rules); the workers prove and record the version it is
            served = self._primerl_loaded(self._primerl_read(folder), into_model=False)
        elif is_offer(folder):
            served = self._primerl_loaded(self._primerl_received(folder, group))
        else:
            served = self._primerl_loaded(self._primerl_read(folder))
        wait_s = 2 * read_offer(folder).timeout_s if is_offer(folder) else 0.0
        expected = awaited_fingerprint(folder, wait_s)
        if self._primerl_receiver is not None:  # the base of the next delta: this version if proven, else none
            self._primerl_receiver.settle(served if served == expected and is_offer(folder) else None)
        if served == expected:
            self.primerl_policy_version = version_number
        else:
            log.warning(
                "primerl: v%d not proven: serves fingerprint %s, the trainer's is %s", version_number, served, expected
            )
        return json.dumps({"version": self.primerl_policy_version, "fingerprint": served, "expected": expected})

    def _primerl_loaded(self, tensors: Iterator[tuple[str, torch.Tensor]], into_model: bool = True) -> str:
        """Load `tensors` in place (`into_model` false: an adapter vLLM loaded already, only fingerprinted); the
        fingerprint of what the model serves now."""
        fingerprint = Fingerprint()

        def fingerprinted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                fingerprint.add(name, tensor)
                yield name, tensor

        if not into_model or failpoint("worker.keep_old_weights"):
            for _ in fingerprinted():
                pass
        else:
            # reload_weights (not model.load_weights): it restores checkpoint-format parameters first and re-runs the
            # post-load processing, which on CPU repacks linear weights into kernel layout and frees the originals.
            try:
                self.model_runner.reload_weights(weights_iterator=fingerprinted(), is_checkpoint_format=True)  # type: ignore[attr-defined]
            except BaseException:
                self._primerl_finish_torn_reload()
                raise
            self._primerl_retie_lm_head()
            self._primerl_repack_cpu_experts()
        if into_model:
            self._primerl_served_digests(fingerprint)
        return fingerprint.hexdigest()

    def _primerl_read(self, folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no .safetensors files")
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def _primerl_received(self, folder: Path, group: str) -> Iterator[tuple[str, torch.Tensor]]:
        if not group:
            raise ValueError(f"{folder} is a collective offer: a load of it must name the replica's group")
        offer = read_offer(folder)
        refusal = store_refusal(offer.store, os.environ.get(WEIGHTS_DIR_ENV))
        if refusal is not None:
            log.warning("primerl: refused to join a collective offer: %s", refusal)
            raise PermissionError(f"refused: {refusal}")
        world = 1 + self.parallel_config.world_size  # type: ignore[attr-defined]
        device = torch.device("cuda", torch.cuda.current_device()) if offer.backend == "nccl" else torch.device("cpu")
        received = self._primerl_receiver_().tensors(offer, group, 1 + self.rank, world, device)  # type: ignore[attr-defined]
        if failpoint("worker.die_mid_transfer"):  # the chaos soak: this worker is killed -9 once tensors arrive
            return _killed_after_the_first(received)
        return received

    def _primerl_receiver_(self) -> WeightReceiver:
        if self._primerl_receiver is None:
            self._primerl_receiver = WeightReceiver()
        return self._primerl_receiver

    def _primerl_served_digests(self, fingerprint: Fingerprint) -> None:
        """Digest again, from the model itself, each loaded tensor it still holds in checkpoint layout (the norms;
        the embedding on one rank): the fingerprint then says what is served, not only what arrived."""
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        for name, layout in fingerprint.layouts.items():
            param = params.get(name)
            if param is not None and (param.shape, param.dtype) == layout:
                fingerprint.digests[name] = tensor_digest(name, param.data)

    def _primerl_finish_torn_reload(self) -> None:
        """A reload that stopped half-way (a transfer that failed) leaves vLLM's layers that got no weights in their
        restored, loader-wrapped state, and the next reload fails on them. Finish it as vLLM would: the layers with
        none get their old tensors back, the others are processed. The weights are then a mix of two versions; the
        orchestrator keeps this server paused until a whole version is loaded."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner  # type: ignore[attr-defined]
        try:
            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
            self._primerl_retie_lm_head()
        except Exception:  # beyond repair by a reload: its next load fails too, and the orchestrator keeps it out
            log.exception("primerl: could not finish a torn reload")

    def _primerl_repack_cpu_experts(self) -> None:
        """vLLM-CPU 0.32 prepacks MoE expert weights for its grouped GEMM only on the first load: on a reload,
        `UnquantizedFusedMoEMethod._setup_kernel` copies the new weights in unpacked and skips the experts'
        `process_weights_after_loading`, so the kernel reads them in the wrong layout (a reload of the same weights
        changed greedy ids here). Prepack them again, as the first load does."""
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
                experts.process_weights_after_loading(module)

    def _primerl_retie_lm_head(self) -> None:
        """A tied LM head receives no weights of its own, so the reload puts its *old* tensors back; tie it to the
        new embedding again and redo its post-load processing (on CPU that prepares the GEMM kernel)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
            return
        head = model.lm_head.tie_weights(model.model.embed_tokens)
        process = getattr(head.quant_method, "process_weights_after_loading", None)
        if process is not None:
            process(head)

    def primerl_get_policy_version(self) -> str:
        return str(self.primerl_policy_version)

    def primerl_collective_identity(self) -> str:
        """This worker's part of its replica's group name: a new process, or a group lost, gives a new one."""
        return self._primerl_receiver_().identity
