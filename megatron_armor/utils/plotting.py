"""Training-curve plots from `metrics.jsonl`."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

DEFAULT_KEYS = (
    "train/reward_mean", "val/accuracy", "loss/clip_fraction", "mismatch/logprob_abs_diff",
    "policy/entropy", "armor/anchors_used",
)
DATASET_KEY = re.compile(r"^val/[^/]+/(avg|pass)@\d+$")  # eval.datasets' per-dataset avg@n and pass@k: drawn too


def plot_metrics(jsonl_path: str | Path, png_path: str | Path, keys: Sequence[str] = DEFAULT_KEYS) -> Path:
    """One panel per metric present in the file, against the step (`keys`, then every dataset's avg@n and pass@k of
    eval.datasets); val/* drawn with markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]
    datasets = dict.fromkeys(k for r in rows for k in r if DATASET_KEY.match(k))
    present = [k for k in (*keys, *datasets) if any(isinstance(r.get(k), float) for r in rows)]
    columns = min(3, max(1, len(present)))
    nrows = max(1, math.ceil(len(present) / columns))
    fig, axes = plt.subplots(nrows, columns, figsize=(4.5 * columns, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float)]
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if key.startswith("val/") else None, markersize=4)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
