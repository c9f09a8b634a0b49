"""Methods added to every vLLM worker (`--worker-extension-cls`) for in-place weight loads.

Called through vLLM's `/collective_rpc` (dev mode). Only string arguments cross the wire; weights are read from
a published directory with safetensors (never a pickle), and only a directory marked stable is loaded.
"""

from pathlib import Path

from safetensors import safe_open

STABLE_MARKER = "STABLE"  # same marker as primerl.trainer.weights; not imported to keep workers torch-light


class PrimerlWorkerExtension:
    primerl_policy_version: int = 0

    def primerl_load_weights(self, path: str, version: str) -> str:
        folder = Path(path)
        if not (folder / STABLE_MARKER).exists():
            raise ValueError(f"{folder} is not a stable weight directory (no {STABLE_MARKER} marker)")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder} holds no .safetensors files")

        def tensors():
            for file in files:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self.model_runner.model.load_weights(weights=tensors())  # type: ignore[attr-defined]
        self.primerl_policy_version = int(version)
        return str(self.primerl_policy_version)

    def primerl_get_policy_version(self) -> str:
        return str(self.primerl_policy_version)
