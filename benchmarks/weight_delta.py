"""How much of a policy changes from one published version to the next: the case for sending only what changed.

    python -m benchmarks.weight_delta RUN_DIR [RUN_DIR ...]

For every pair of consecutive published versions a run still keeps (`weights/step_N`, full weights), per version
step: the fraction of values that differ in the published dtype, and after rounding both to bf16 (what a bf16
server holds); and what a delta would cost against the full version in bf16: as changed positions (int32) and
values (bf16); as `weights.delta` sends it (primerl.transport.delta: a bit per value, then the changed values); and as
the XOR of the two versions' bf16 bits compressed with zlib (level 1). Full = 2 bytes per value.
"""

import argparse
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from primerl.transport.atomic import is_stable
from primerl.transport.delta import encode


def versions(run: Path) -> list[Path]:
    found = sorted(p for p in (run / "weights").glob("step_*") if is_stable(p) and (p / "model.safetensors").exists())
    return found


def compare(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    values = changed = changed_bf16 = xor_bytes = delta_bytes = 0
    for name, a in old.items():
        b = new[name]
        values += a.numel()
        changed += int((a != b).sum())
        a16, b16 = a.to(torch.bfloat16).view(torch.int16), b.to(torch.bfloat16).view(torch.int16)
        changed_bf16 += int((a16 != b16).sum())
        xor_bytes += len(zlib.compress((a16 ^ b16).numpy().tobytes(), 1))
        delta = encode(b.to(torch.bfloat16).reshape(-1), a.to(torch.bfloat16).reshape(-1))
        delta_bytes += 2 * a.numel() if delta is None else delta[1].numel()
    full = 2 * values
    return {
        "values": values,
        "changed": changed / values,
        "changed_bf16": changed_bf16 / values,
        "sparse_ratio": full / max(6 * changed_bf16, 1),
        "delta_ratio": full / max(delta_bytes, 1),
        "xor_zlib_ratio": full / max(xor_bytes, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print(
        f"{'run':>32} {'versions':>10} {'values':>9} {'changed':>8} {'bf16 changed':>13} {'full/sparse':>12} {'full/delta':>11} {'full/xor+zlib':>14}"
    )
    for run in args.runs:
        found = versions(run)
        if len(found) < 2:
            print(f"{run}: fewer than two published versions", file=sys.stderr)
            continue
        for old, new in zip(found, found[1:]):
            r = compare(load_file(old / "model.safetensors"), load_file(new / "model.safetensors"))
            print(
                f"{str(run)[-32:]:>32} {old.name[-3:]}->{new.name[-3:]:<3} {r['values']:>9} {r['changed']:>8.1%} "
                f"{r['changed_bf16']:>13.2%} {r['sparse_ratio']:>11.1f}x {r['delta_ratio']:>10.1f}x {r['xor_zlib_ratio']:>13.1f}x"
            )


if __name__ == "__main__":
    main()
