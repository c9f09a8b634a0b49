"""`python -m primerl.compare`: compare runs recorded in the MLflow ledger.

Selects runs by experiment, sweep (parent run id or sweep directory) and an MLflow filter string, prints the
settings that differ between them and their final metrics, and writes a PNG of their reward curves. With --by-seed,
runs that differ only in their seed make one row: held-out reward per eval, minutes, samples trained per second and
minutes to a target reward (and any metric's mean over each run, --mean), each as mean [min, max] over the seeds.

    python -m primerl.compare --experiment reverse_text
    python -m primerl.compare --sweep multirun/reverse_text/2026-12-02_10-00-00 --plot sweep.png
    python -m primerl.compare --filter "params.trainer.optim.lr = '3e-05'"
    python -m primerl.compare --rerun-of 0123456789abcdef0123456789abcdef
    python -m primerl.compare --sweep multirun/reverse_text/2026-12-02_10-00-00 --by-seed --target 0.95 --markdown
    python -m primerl.compare --sweep multirun/off_policy --by-seed --mean trainer/mismatch_kl
"""

import argparse
import os
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from primerl.ledger.seed_groups import group, mean_curves, seed_table, setting_keys, summarize
from primerl.plot import plot_curves
from primerl.utils.secrets import SECRET_KEYS

REWARD = "orchestrator/reward/mean"
FINAL_METRICS = (REWARD, "trainer/loss", "trainer/mismatch_kl", "orchestrator/rollouts/failed")
RESULT_PARAMS = ("sft.result.loss_final",)
NOISY_PARAMS = ("output_dir", "hydra", "cache_dir", "sft.result.")  # not settings: paths, results


def default_uri(store_dir: str) -> str:
    return f"sqlite:///{Path(store_dir).resolve() / 'mlflow.db'}"


def rerun_family(client: MlflowClient, run_id: str) -> list:
    """The run `run_id` and every rerun of it (tag rerun_of, set by primerl rerun), oldest first."""
    original = client.get_run(run_id)
    reruns = client.search_runs(
        [original.info.experiment_id], f"tags.rerun_of = '{run_id}'", order_by=["attributes.start_time ASC"]
    )
    return [original, *reruns]


def select_runs(
    client: MlflowClient, experiment: str | None, sweeps: list[str], filter_string: str, kind: str = "train"
) -> list:
    """The runs of `kind` (train, sft or eval: the `primerl.kind` tag) of `experiment` (every one when None) that
    pass `filter_string`: those of each of `sweeps` in turn (a parent run id or a sweep directory each), or all of
    them when `sweeps` is empty. A sweep's parent run is never one of them."""
    experiments = [client.get_experiment_by_name(experiment)] if experiment else client.search_experiments()
    ids = [e.experiment_id for e in experiments if e is not None]
    if not ids:
        raise SystemExit(f"compare: no experiment named '{experiment}' in {client.tracking_uri}")
    clauses = [f for f in [filter_string, f"tags.`primerl.kind` = '{kind}'"] if f]
    runs = []
    for sweep in sweeps or [None]:
        these = list(clauses)
        if sweep and Path(sweep).is_dir():
            these.append(f"tags.`primerl.sweep_dir` = '{Path(sweep).resolve()}'")
        elif sweep:
            these.append(f"tags.mlflow.parentRunId = '{sweep}'")
        runs += client.search_runs(ids, " and ".join(these), order_by=["attributes.start_time ASC"], max_results=500)
    return runs


def differing_params(runs: list) -> list[str]:
    """The settings whose values differ between `runs`; paths, results and secrets (masked) are not settings."""
    keys = sorted({k for r in runs for k in r.data.params if not k.startswith(NOISY_PARAMS) and k not in SECRET_KEYS})
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def eval_metrics(runs: list) -> list[str]:
    """The online evals' mean rewards any of the runs has (`eval/<env>/reward_mean`)."""
    return sorted({m for r in runs for m in r.data.metrics if m.startswith("eval/") and m.endswith("/reward_mean")})


def render(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [rows[0], ["---"] * len(rows[0]), *rows[1:]]
        return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in lines)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


def table(runs: list, keys: list[str]) -> list[list[str]]:
    evals = eval_metrics(runs)
    header = [
        "run",
        "status",
        *keys,
        *(m.split("/", 1)[-1] for m in FINAL_METRICS),
        *(f"eval {m.split('/')[1]}" for m in evals),
        *(p.removeprefix("sft.result.") + " (sft)" for p in RESULT_PARAMS),
    ]
    rows = [header]
    for r in runs:
        metrics = [f"{r.data.metrics[m]:.4g}" if m in r.data.metrics else "-" for m in (*FINAL_METRICS, *evals)]
        rows.append(
            [
                r.info.run_name or r.info.run_id[:8],
                r.info.status,
                *(r.data.params.get(k, "-") for k in keys),
                *metrics,
                *(r.data.params.get(p, "-") for p in RESULT_PARAMS),
            ]
        )
    return rows


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl compare",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + __doc__.split("\n\n")[2],
    )
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the sqlite store in --store-dir)",
    )
    parser.add_argument(
        "--store-dir", default="outputs", help="where the embedded store mlflow.db lives (default: %(default)s)"
    )
    parser.add_argument("--experiment", help="experiment name (default: every experiment)")
    parser.add_argument(
        "--sweep", action="append", default=[], help="a sweep's parent run id or its sweep directory (repeatable)"
    )
    parser.add_argument("--rerun-of", help="a run id: that run and its reruns (primerl rerun)")
    parser.add_argument(
        "--kind", default="train", choices=("train", "sft", "eval"), help="which runs (default: %(default)s)"
    )
    parser.add_argument(
        "--filter", default="", help="an MLflow search filter, e.g. \"params.seed = '1'\" (default: none)"
    )
    parser.add_argument(
        "--plot",
        default="compare_rewards.png",
        help="where the PNG of reward curves is written, relative to the current directory; '' for none "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--by-seed", action="store_true", help="one row per setting, mean [min, max] over the runs' seeds"
    )
    parser.add_argument(
        "--target", type=float, default=0.95, help="--by-seed: the held-out reward timed (default: %(default)s)"
    )
    parser.add_argument(
        "--mean",
        action="append",
        default=[],
        metavar="KEY",
        help="--by-seed: a column of metric KEY's mean over each run's rows, e.g. trainer/mismatch_kl (repeatable)",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri(args.store_dir)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        print(f"compare: no ledger at {uri}", file=sys.stderr)
        return 2
    client = MlflowClient(uri)
    if args.rerun_of:
        runs = rerun_family(client, args.rerun_of)
    else:
        runs = select_runs(client, args.experiment, args.sweep, args.filter, args.kind)
    if not runs:
        print("compare: no runs match", file=sys.stderr)
        return 1
    keys = differing_params(runs)
    print(f"{len(runs)} run(s) in {uri}; settings that differ: {', '.join(keys) or '(none)'}")
    if args.by_seed:
        return by_seed(client, runs, keys, args)
    print(render(table(runs, keys), args.markdown))
    if args.plot:
        curves = {}
        for r in runs:
            label = r.info.run_name or r.info.run_id[:8]
            if keys:
                label += " " + " ".join(f"{k.rsplit('.', 1)[-1]}={r.data.params.get(k)}" for k in keys)
            curves[label] = [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, REWARD)]
        print(f"reward curves: {plot_curves(curves, args.plot, title='reward per step')}")
    return 0


def by_seed(client: MlflowClient, runs: list, keys: list[str], args: argparse.Namespace) -> int:
    keys = setting_keys(runs, keys)
    mean_keys = tuple(args.mean)
    groups = group([summarize(client, r, keys, args.target, mean_keys) for r in runs])
    print(render(seed_table(groups, keys, args.target, mean_keys), args.markdown))
    if args.plot:
        curves = mean_curves(groups, keys)
        means = {label: [(s, mean) for s, mean, _, _ in points] for label, points in curves.items()}
        bands = {label: [(s, low, high) for s, _, low, high in points] for label, points in curves.items()}
        title = "held-out reward, mean over seeds (band: min to max)"
        print(f"held-out reward: {plot_curves(means, args.plot, title, 'held-out reward', bands)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
