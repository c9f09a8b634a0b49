"""Methods added to every vLLM worker (`--worker-extension-cls`) for in-place weight loads.

Called through vLLM's `/collective_rpc` (dev mode; primerl.inference.guard lets only `primerl_*` methods through).
Only string arguments cross the wire. Weights are read with safetensors (never a pickle), only from a directory marked
STABLE, and only from below the run's own weights directory (`WEIGHTS_DIR_ENV`, set by the server's launcher): a
path anywhere else is refused and logged, so whoever can reach the route cannot load weights of their choosing.
"""

import logging
import os
from pathlib import Path

from safetensors import safe_open

from primerl.transport.atomic import STABLE_MARKER
from primerl.transport.weights import WEIGHTS_DIR_ENV, inside, is_adapter

log = logging.getLogger(__name__)
IDLE_SPIN_ENV = "PRIMERL_VLLM_IDLE_SPIN_S"  # set by primerl.inference.server from inference.cpu_idle_spin_s


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


if os.environ.get(IDLE_SPIN_ENV):  # imported by vLLM in each worker process (--worker-extension-cls)
    shorten_idle_spin(float(os.environ[IDLE_SPIN_ENV]))


class PrimerlWorkerExtension:
    primerl_policy_version: int = 0

    def primerl_load_weights(self, path: str, version: str) -> str:
        root = os.environ.get(WEIGHTS_DIR_ENV)
        if not root or not inside(path, root):
            log.warning(
                "primerl: refused to load weights from %s: not inside the run's weights directory %s", path, root
            )
            raise PermissionError(f"refused: {path} is not inside the run's weights directory ({root})")
        folder = Path(path)
        if not (folder / STABLE_MARKER).exists():
            raise ValueError(f"{folder} is not a stable weight directory (no {STABLE_MARKER} marker)")
        version_number = int(version)  # a bad version fails here, before any weight is touched
        if is_adapter(folder):
            # a LoRA policy: the engine's LoRA manager has loaded the adapter (/v1/load_lora_adapter, which the
            # guard holds to the same directory rules); the workers record the version it is
            self.primerl_policy_version = version_number
            return str(self.primerl_policy_version)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no .safetensors files")
        escaping = [file.name for file in files if not inside(file, root)]  # a symlink out of the weights directory
        if escaping:
            log.warning(
                "primerl: refused to load weights from %s: %s leave the run's weights directory", path, escaping
            )
            raise PermissionError(f"refused: {', '.join(escaping)} in {path} lead outside the run's weights directory")

        def tensors():
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        # reload_weights (not model.load_weights): it restores checkpoint-format parameters first and re-runs the
        # post-load processing, which on CPU repacks linear weights into kernel layout and frees the originals.
        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        self._retie_lm_head()
        self.primerl_policy_version = version_number
        return str(self.primerl_policy_version)

    def _retie_lm_head(self) -> None:
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
