"""Trainer -> inference: policy version v is the HF directory `weights_path(run, v)`, loaded only once STABLE.

The inference server loads weights by path (primerl.inference.worker_extension), and only from below the run's own
weights directory, which it is told through `WEIGHTS_DIR_ENV`. Clients name the policy `SERVED_MODEL_NAME`, not a
path that changes with every version. With LoRA (`model.lora.rank` > 0) a version is a peft adapter directory
(`is_adapter`); the server then serves the base model as `ADAPTER_BASE_NAME` and the adapter as `SERVED_MODEL_NAME`,
so clients name the policy the same way either way.

With `weights.transport=collective` (primerl.transport.collective) a version's directory holds no weights but an
offer (`OFFER_FILE`: the tensors, their buckets, where to join); the orchestrator answers it with the replicas that
will take it (`RECEIVERS_FILE`), and the trainer then sends. Every published version, whichever the transport, has
a fingerprint of its weights (`FINGERPRINT_FILE`, primerl.transport.fingerprint), which each replica's load must
reproduce. This module imports no torch: vLLM's workers and the orchestrator import it.
"""

import json
import os
import time
import uuid
from pathlib import Path

from primerl.transport.atomic import STABLE_MARKER, TEMPORARY_PREFIX, latest_stable, remove_published, write_json
from primerl.transport.run_dir import weights_path, weights_root

SERVED_MODEL_NAME = "policy"
ADAPTER_BASE_NAME = "policy-base"  # the base model's name on a server whose policy is an adapter
WEIGHTS_DIR_ENV = "PRIMERL_WEIGHTS_DIR"
# on a generate answer: the policy version the server served when it answered (primerl.inference.served_version)
POLICY_VERSION_HEADER = "x-primerl-policy-version"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # peft's: marks a directory as an adapter, not a whole model
OFFER_FILE = "offer.json"  # marks a version sent by collective: its tensors, buckets and rendezvous
RECEIVERS_FILE = "receivers.json"  # the orchestrator's answer to an offer: which replica groups take it
FINGERPRINT_FILE = "fingerprint.json"  # the trainer's fingerprint of the version's weights
UNPROVEN = -1  # the policy version a worker answers while what it serves is not proven to be any published version


def is_adapter(path: str | Path) -> bool:
    """Whether the weights directory at `path` holds a LoRA adapter (peft's format) rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def is_offer(path: str | Path) -> bool:
    """Whether the weights directory at `path` is a collective offer (its weights travel by process group)."""
    return (Path(path) / OFFER_FILE).is_file()


def read_json_file(path: str | Path) -> dict | None:
    """The JSON object at `path`, or None when it is not there (yet)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def answer_offer(version_dir: str | Path, offer_id: str, groups: dict[str, int]) -> dict[str, int]:
    """Answer the offer `offer_id` in `version_dir` with the replica groups that take it (name -> members, trainer
    rank 0 included), unless it has an answer already: the first answer stands (written whole, then linked into
    place, which fails if one is there), so the orchestrator's answer and the trainer's withdrawal (no groups) cannot
    both be acted on. Returns the groups of the answer that stands."""
    folder = Path(version_dir)
    temporary = folder / f"{TEMPORARY_PREFIX}{RECEIVERS_FILE}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temporary.write_text(json.dumps({"offer": offer_id, "groups": groups}))
    try:
        os.link(temporary, folder / RECEIVERS_FILE)
    except FileExistsError:
        pass
    finally:
        temporary.unlink()
    standing = read_json_file(folder / RECEIVERS_FILE)
    return dict(standing["groups"]) if standing and standing["offer"] == offer_id else {}


def write_fingerprint(version_dir: str | Path, fingerprint: str) -> None:
    write_json(Path(version_dir) / FINGERPRINT_FILE, {"fingerprint": fingerprint})


def published_fingerprint(version_dir: str | Path) -> str | None:
    """The trainer's fingerprint of the version in `version_dir` (None: not written yet)."""
    found = read_json_file(Path(version_dir) / FINGERPRINT_FILE)
    return None if found is None else str(found["fingerprint"])


def load_deadline_s(version_dir: str | Path, default_s: float) -> float:
    """How long a load of the version in `version_dir` may take: for a collective offer, its own limits (a worker may
    wait 2 x its timeout_s to join, for each bucket, and for the trainer's fingerprint), never less than `default_s`;
    for files, `default_s`."""
    offer = read_json_file(Path(version_dir) / OFFER_FILE)
    if offer is None:
        return default_s
    return max(default_s, 2 * float(offer["timeout_s"]) * (len(offer["buckets"]) + 2) + 30)


def awaited_fingerprint(version_dir: str | Path, wait_s: float) -> str | None:
    """The trainer's fingerprint of the version in `version_dir`, waiting up to `wait_s` for it (a collective offer's
    is written once its last bucket left); None when it did not come."""
    deadline = time.monotonic() + wait_s
    while (found := published_fingerprint(version_dir)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def latest_stable_version(run_dir: str | Path) -> int | None:
    """The newest published policy version, if any."""
    return latest_stable(weights_root(run_dir))


def inside(path: str | Path, root: str | Path) -> bool:
    """Whether `path` lies strictly below `root` once both are resolved (`..` and symlinks followed)."""
    path, root = Path(path).resolve(), Path(root).resolve()
    return path != root and path.is_relative_to(root)


def weights_dir_refusal(path: str | Path, root: str | Path | None) -> str | None:
    """Why an inference server may not load the weights directory `path`, or None. It must lie below the run's
    weights directory `root` (`..` and symlinks followed), be STABLE, and hold no file that is a symlink leading out
    of `root`: whoever reaches the load routes cannot make a server read weights of their choosing."""
    if not root or not inside(path, root):
        return f"{path} is not inside the run's weights directory ({root})"
    folder = Path(path)
    if not (folder / STABLE_MARKER).is_file():
        return f"{folder} is not a stable weight directory (no {STABLE_MARKER} marker)"
    escaping = sorted(file.name for file in folder.iterdir() if not inside(file, root))
    if escaping:
        return f"{', '.join(escaping)} in {folder} lead outside the run's weights directory"
    return None


def rendezvous_dir(run_dir: str | Path) -> Path:
    """Where the trainer's collective rendezvous (a FileStore) lives: inside the run's private weights directory."""
    return weights_root(run_dir) / ".rendezvous"


def store_refusal(store: str | Path, root: str | Path | None) -> str | None:
    """Why a worker may not join a collective offer's rendezvous file `store`, or None: it must lie below the run's
    weights directory `root`, where only the run's own user can write (an offer naming a file elsewhere would have the
    worker create and write it)."""
    if not root or not inside(store, root):
        return f"the offer's rendezvous {store} is not inside the run's weights directory ({root})"
    return None


def versions_to_keep(async_level: int) -> int:
    """How many of the newest published versions the trainer keeps. When it publishes v, batch v-1 was cut while the
    orchestrator served a policy no older than v-1-async_level; that is the oldest version a replica coming back may
    be asked to load (the one the others serve). So v-1-async_level .. v stay: async_level + 2 versions."""
    return async_level + 2


def drop_old_version(run_dir: str | Path, published: int, keep: int) -> None:
    """After publishing `published`, remove the version that fell out of the newest `keep`."""
    old = published - keep
    if old > 0:
        remove_published(weights_path(run_dir, old))
