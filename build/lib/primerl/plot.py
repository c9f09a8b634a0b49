"""Reward curves as PNG (headless matplotlib), for run artifacts, experiment write-ups and `primerl.compare`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(
    curves: dict[str, list[tuple[int, float]]], path: str | Path, title: str = "", ylabel: str = "mean reward"
) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for label, points in curves.items():
        if points:
            steps, values = zip(*sorted(points))
            ax.plot(steps, values, marker="o", markersize=3, label=label)
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
