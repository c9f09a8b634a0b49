"""Reward curves as PNG (headless matplotlib), for run artifacts, experiment write-ups and `primerl.compare`."""

from pathlib import Path

import matplotlib

from primerl.metrics import EVAL, ORCHESTRATOR, OrchestratorMetric, read_metrics
from primerl.transport.run_dir import reward_plot_path

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(
    curves: dict[str, list[tuple[int, float]]],
    path: str | Path,
    title: str = "",
    ylabel: str = "mean reward",
    bands: dict[str, list[tuple[int, float, float]]] | None = None,
) -> Path:
    """One line per curve; `bands[label]`, (step, low, high) points, shades a range around that curve."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for label, points in curves.items():
        if points:
            steps, values = zip(*sorted(points))
            (line,) = ax.plot(steps, values, marker="o", markersize=3, label=label)
            if bands and bands.get(label):
                band_steps, lows, highs = zip(*sorted(bands[label]))
                ax.fill_between(band_steps, lows, highs, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def reward_plot(run_dir: Path, title: str) -> Path | None:
    """The training reward per step, and each online eval's mean reward at the policy versions it scored."""
    reward = OrchestratorMetric.REWARD_MEAN
    points = [(r["step"], r[reward]) for r in read_metrics(run_dir, ORCHESTRATOR) if r.get(reward) is not None]
    if not points:
        return None
    curves = {reward: points}
    for row in read_metrics(run_dir, EVAL):
        for key, value in row.items():
            if key.endswith("/reward_mean") and value is not None:
                curves.setdefault(f"eval {key.removesuffix('/reward_mean')}", []).append((row["step"], value))
    return plot_curves(curves, reward_plot_path(run_dir), title=title)
