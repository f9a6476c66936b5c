"""`armor diagnose`: per-matrix update geometry of later checkpoints against a base, as JSON and plots.

For every selected 2-D linear weight and every later checkpoint t, with dW_t = W_t - W0 (spec opd.md §2):
unchanged fraction, principal angles (degrees), spectral drift, principal / low-magnitude mask overlap,
update norm ||dW_t||_F, stable rank, Hill tail index, and Sim_K(t, t_end) with t_end the latest checkpoint.
Aggregates per layer type and over all matrices: the unchanged fraction is parameter-count weighted,
every other value is an unweighted mean over matrices (undefined values skipped); `update_density` is the
per-matrix mean of the changed fraction. Non-finite values are written as null.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_armor.diagnostics.geometry import (
    Factored, basis_overlap, factor, hill_tail_index, mask_overlap, principal_angles, spectral_drift,
    stable_rank, top_right_vectors, unchanged_mask, update_scale,
)
from megatron_armor.diagnostics.plots import plot_layer_types, plot_trajectory
from megatron_armor.diagnostics.settings import DiagnoseConfig
from megatron_armor.diagnostics.sources import LinearWeight, Snapshot, checkpoint_snapshots, linear_weights

REPORT_FILE = "report.json"


@dataclass(frozen=True)
class MatrixMetrics:
    """Diagnostics of one matrix at one checkpoint; angles in degrees, NaN where undefined."""

    numel: int
    unchanged: int  # entries unchanged under the bf16-aware rule
    unchanged_fraction: float
    angle_left_mean: float
    angle_left_max: float
    angle_right_mean: float
    angle_right_max: float
    spectral_drift: float
    overlap_principal: float
    overlap_low_magnitude: float
    update_norm: float  # ||dW||_F
    stable_rank: float
    hill_index: float
    sim_k: float = math.nan  # Sim_K(t, t_end); filled once the whole trajectory is known


# Values averaged over matrices (unweighted) in the per-type and overall aggregates.
MEAN_METRICS = tuple(
    f.name for f in fields(MatrixMetrics) if f.name not in ("numel", "unchanged", "unchanged_fraction")
)


def _checkpoint_metrics(
    f0: Factored, w1: torch.Tensor, s: DiagnoseConfig
) -> tuple[MatrixMetrics, torch.Tensor | None]:
    """Metrics of W_t against the factored W0, and V_K(t) [in, K] (None for a zero update)."""
    f1 = factor(w1)
    fd = factor(f1.weight - f0.weight)
    angles = principal_angles(f0, f1, s.k_angles)
    unchanged = int(unchanged_mask(f0, f1, s.eta).sum())
    norm = update_scale(fd)
    metrics = MatrixMetrics(
        numel=f0.weight.numel(),
        unchanged=unchanged,
        unchanged_fraction=unchanged / f0.weight.numel(),
        angle_left_mean=angles.left.mean().item(),
        angle_left_max=angles.left.max().item(),
        angle_right_mean=angles.right.mean().item(),
        angle_right_max=angles.right.max().item(),
        spectral_drift=spectral_drift(f0, f1),
        overlap_principal=mask_overlap(f0, f1, "principal", s.mask_rank, s.mask_alpha, s.eta),
        overlap_low_magnitude=mask_overlap(f0, f1, "low_magnitude", s.mask_rank, s.mask_alpha, s.eta),
        update_norm=norm,
        stable_rank=stable_rank(fd),
        hill_index=hill_tail_index(fd, s.k_hill),
    )
    return metrics, (top_right_vectors(fd, s.k_sim) if norm > 0 else None)


def matrix_trajectory(w0: torch.Tensor, later: Iterable[torch.Tensor], s: DiagnoseConfig) -> list[MatrixMetrics]:
    """Metrics of one matrix [out, in] at each later checkpoint (in trajectory order; the last is t_end)."""
    f0 = factor(w0)
    results = [_checkpoint_metrics(f0, w1, s) for w1 in later]
    if not results:
        raise ValueError("matrix_trajectory needs at least one later checkpoint")
    rows, bases = zip(*results)
    end = bases[-1]
    return [
        replace(row, sim_k=basis_overlap(v, end) if v is not None and end is not None else math.nan)
        for row, v in zip(rows, bases)
    ]


def _mean(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def aggregate(rows: Sequence[MatrixMetrics]) -> dict[str, float]:
    """Weighted unchanged fraction, mean changed fraction per matrix, and unweighted means of the rest."""
    summary = {
        "matrices": len(rows),
        "unchanged_fraction": sum(r.unchanged for r in rows) / sum(r.numel for r in rows),
        "update_density": 1.0 - _mean(r.unchanged_fraction for r in rows),
    }
    summary.update({name: _mean(getattr(r, name) for r in rows) for name in MEAN_METRICS})
    return summary


def _load(snapshot: Snapshot, weight: LinearWeight, base: torch.Tensor | None = None) -> torch.Tensor:
    """The matrix from a snapshot, checked to be 2-D and shaped like the base's."""
    tensor = snapshot.source.get(weight.name)
    if tensor.dim() != 2:
        raise ValueError(f"{snapshot.label}: {weight.name!r} is not a matrix (shape {tuple(tensor.shape)})")
    if base is not None and tensor.shape != base.shape:
        raise ValueError(f"{snapshot.label}: {weight.name!r} has shape {tuple(tensor.shape)}, "
                         f"the base has {tuple(base.shape)}")
    return tensor


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def diagnose_sources(
    base: Snapshot,
    checkpoints: Sequence[Snapshot],
    out_dir: str | Path,
    settings: DiagnoseConfig = DiagnoseConfig(),
) -> dict:
    """Diagnose `checkpoints` (sorted by step here) against `base`; write report.json and plots to out_dir."""
    if not checkpoints:
        raise ValueError("diagnose needs at least one checkpoint to compare with the base")
    checkpoints = sorted(checkpoints, key=lambda c: c.step)
    weights = linear_weights(base.source.names(), settings.layer_types)
    if not weights:
        raise ValueError(f"{base.label}: no 2-D linear weights of types {settings.layer_types} found "
                         "(expected HF names like model.layers.0.self_attn.q_proj.weight)")
    matrices, shapes = {}, {}
    for w in tqdm(weights, desc="diagnose", unit="matrix", disable=None):
        w0 = _load(base, w)
        later = (_load(c, w, w0) for c in checkpoints)
        matrices[w], shapes[w] = matrix_trajectory(w0, later, settings), list(w0.shape)

    def summarize(i: int) -> dict:
        by_type = {t: aggregate([rows[i] for w, rows in matrices.items() if w.layer_type == t])
                   for t in settings.layer_types if any(w.layer_type == t for w in matrices)}
        return {"label": checkpoints[i].label, "step": checkpoints[i].step,
                "all": aggregate([rows[i] for rows in matrices.values()]), "by_layer_type": by_type}

    report = {
        "settings": asdict(settings),
        "base": base.label,
        "checkpoints": [summarize(i) for i in range(len(checkpoints))],
        "matrices": {
            w.name: {"layer": w.layer, "layer_type": w.layer_type, "shape": shapes[w],
                     "checkpoints": [asdict(r) for r in rows]}
            for w, rows in matrices.items()
        },
    }
    report = _json_safe(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = [plot_layer_types(report, out).name, plot_trajectory(report, out).name]
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    return report


def diagnose(
    base: str | Path,
    checkpoints: Sequence[str | Path],
    out_dir: str | Path,
    settings: DiagnoseConfig = DiagnoseConfig(),
) -> dict:
    """`diagnose_sources` for checkpoint directories, HF or Megatron (read in place, one matrix at a
    time); returns the report written to out_dir/report.json."""
    [base_snapshot] = checkpoint_snapshots([base])
    return diagnose_sources(base_snapshot, checkpoint_snapshots(checkpoints), out_dir, settings)
