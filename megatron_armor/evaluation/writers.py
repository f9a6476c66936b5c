"""What `armor eval` writes to its output directory:

    samples/<checkpoint>/<dataset>.jsonl   one row per response (`SampleRecord`)
    results.json                           {"seed", "checkpoints": [{"label", "step", "path", "datasets": {name: metrics}}]}
    results.md                             one row per checkpoint, a column per dataset and metric
    plots/<metric>.png                     each metric against the checkpoint's step, a line per dataset (2+ checkpoints)

An evaluation writes them afresh (`clear_outputs` first): nothing of an earlier evaluation into the same directory
is kept, so evaluating part of the datasets again leaves no stale numbers beside the new ones.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_armor.evaluation.scores import SampleRecord

RESULTS_JSON, RESULTS_MD, SAMPLES_DIR, PLOTS_DIR = "results.json", "results.md", "samples", "plots"


@dataclass(frozen=True)
class CheckpointResult:
    """One checkpoint's metrics: {dataset name: {metric: value}}; `step` None for a checkpoint outside a run."""

    label: str
    step: int | None
    path: str
    datasets: dict[str, dict[str, float]]


def clear_outputs(out: Path) -> None:
    """Remove what an earlier evaluation wrote to `out` (only the files and folders listed above)."""
    for name in (SAMPLES_DIR, PLOTS_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (RESULTS_JSON, RESULTS_MD):
        (out / name).unlink(missing_ok=True)


def write_samples(out: Path, checkpoint: str, dataset: str, records: Sequence[SampleRecord]) -> Path:
    """samples/<checkpoint>/<dataset>.jsonl."""
    path = out / SAMPLES_DIR / checkpoint / f"{dataset}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return path


def write_results(out: Path, results: Sequence[CheckpointResult], *, seed: int) -> None:
    """results.json, results.md and (two or more checkpoints) plots/<metric>.png."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"seed": seed, "checkpoints": [vars(r) for r in results]}
    (out / RESULTS_JSON).write_text(json.dumps(payload, indent=2) + "\n")
    (out / RESULTS_MD).write_text(markdown_table(results))
    if len(results) > 1:
        plot_metrics(results, out / PLOTS_DIR)


def _columns(results: Sequence[CheckpointResult]) -> list[tuple[str, str]]:
    """(dataset, metric) pairs in first-seen order."""
    columns: dict[tuple[str, str], None] = {}
    for result in results:
        for dataset, metrics in result.datasets.items():
            columns.update(dict.fromkeys((dataset, metric) for metric in metrics))
    return list(columns)


def markdown_table(results: Sequence[CheckpointResult]) -> str:
    """A Markdown table: a row per checkpoint (label, step), a column per `dataset metric`, values to 4 places."""
    columns = _columns(results)
    lines = ["| checkpoint | step | " + " | ".join(f"{d} {m}" for d, m in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for r in results:
        cells = [_cell(r.datasets.get(d, {}).get(m)) for d, m in columns]
        lines.append(f"| {r.label} | {'' if r.step is None else r.step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def plot_metrics(results: Sequence[CheckpointResult], plots: Path) -> list[Path]:
    """plots/<metric>.png: the metric against the checkpoint's step (its order when a step is unknown), one line
    per dataset that has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots.mkdir(parents=True, exist_ok=True)
    x = [r.step if r.step is not None else i for i, r in enumerate(results)]
    written = []
    for metric in dict.fromkeys(m for _, m in _columns(results)):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for dataset in dict.fromkeys(d for r in results for d in r.datasets):
            points = [(xi, r.datasets[dataset][metric]) for xi, r in zip(x, results)
                      if metric in r.datasets.get(dataset, {})]
            if points:
                ax.plot(*zip(*points), marker="o", label=dataset)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plots / f"{re.sub(r'[^A-Za-z0-9_.@-]', '_', metric)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
