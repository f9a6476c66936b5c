"""PNG plots of a diagnose report (the dict written to report.json): per layer type, and over checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

LAYER_TYPE_METRICS = (
    "unchanged_fraction", "update_density", "angle_left_mean", "angle_right_mean", "spectral_drift",
    "overlap_principal", "overlap_low_magnitude", "update_norm", "stable_rank", "hill_index",
)
TRAJECTORY_METRICS = (
    "stable_rank", "update_norm", "hill_index", "sim_k", "unchanged_fraction", "angle_right_mean", "spectral_drift",
)
_OVERLAPS = ("overlap_principal", "overlap_low_magnitude")


def _value(summary: dict, key: str) -> float:
    value = summary.get(key)
    return math.nan if value is None else value


def _panels(n: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(4, n)
    rows = math.ceil(n / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layer_types(report: dict, out_dir: Path) -> Path:
    """by_layer_type.png: one bar per layer type for each metric, at the latest checkpoint."""
    last = report["checkpoints"][-1]
    types = list(last["by_layer_type"])
    fig, axes = _panels(len(LAYER_TYPE_METRICS))
    for ax, key in zip(axes, LAYER_TYPE_METRICS):
        ax.bar(types, [_value(last["by_layer_type"][t], key) for t in types], color="tab:blue")
        if key in _OVERLAPS:
            ax.axhline(report["settings"]["mask_alpha"], color="gray", linestyle="--", label="random")
            ax.legend(fontsize=7)
        ax.set_title(f"{key} ({last['label']})", fontsize=9)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, out_dir / "by_layer_type.png")


def plot_trajectory(report: dict, out_dir: Path) -> Path:
    """trajectory.png: each metric against the checkpoint step, one line per layer type and one for all."""
    checkpoints = report["checkpoints"]
    steps = [c["step"] for c in checkpoints]
    types = list(checkpoints[-1]["by_layer_type"])
    fig, axes = _panels(len(TRAJECTORY_METRICS))
    for ax, key in zip(axes, TRAJECTORY_METRICS):
        for t in types:
            ax.plot(steps, [_value(c["by_layer_type"][t], key) for c in checkpoints], marker="o", markersize=3, label=t)
        ax.plot(steps, [_value(c["all"], key) for c in checkpoints], color="black", linewidth=2, label="all")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, out_dir / "trajectory.png")
