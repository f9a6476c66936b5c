"""Parameter-space diagnostics of one 2-D weight matrix and its update (spec opd.md §2).

Notation: `w0` [out, in] is the weight at stage init, `w1` [out, in] a later checkpoint, `delta` = w1 - w0.
Every SVD is a float64 CPU SVD (GPU SVD is unstable for near-identical matrices). A matrix argument may
be a tensor (any float dtype, any device) or a `Factored` matrix, which carries its SVD so a caller that
asks several questions of one matrix decomposes it once. Scalars are Python floats; NaN marks a value the
formula leaves undefined (e.g. the stable rank of a zero update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_armor.diagnostics.settings import UNCHANGED_ETA

MASK_KINDS = ("principal", "low_magnitude")


@dataclass(frozen=True)
class Factored:
    """A 2-D matrix in float64 on the CPU with its thin SVD, weight = left @ diag(singular_values) @ right_h
    (torch.linalg.svd's U, S, Vh)."""

    weight: torch.Tensor  # [m, n] float64
    left: torch.Tensor  # [m, r] float64, r = min(m, n): left singular vectors as columns
    singular_values: torch.Tensor  # [r] float64, descending
    right_h: torch.Tensor  # [r, n] float64: right singular vectors as rows


@dataclass(frozen=True)
class PrincipalAngles:
    """Principal angles between the top-k singular subspaces of two matrices, in degrees, ascending."""

    left: torch.Tensor  # [k] float64, between span(U0[:, :k]) and span(U1[:, :k])
    right: torch.Tensor  # [k] float64, between span(V0[:, :k]) and span(V1[:, :k])


Matrix = torch.Tensor | Factored


def factor(matrix: Matrix) -> Factored:
    """The float64 CPU thin SVD of a 2-D matrix (returned unchanged if already factored)."""
    if isinstance(matrix, Factored):
        return matrix
    if matrix.dim() != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {tuple(matrix.shape)}")
    weight = matrix.detach().to("cpu", torch.float64)
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    return Factored(weight, u, s, vh)


def _weight(matrix: Matrix) -> torch.Tensor:
    return matrix.weight if isinstance(matrix, Factored) else matrix


def _check_same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"matrices must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def _clamp_rank(k: int, f: Factored) -> int:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return min(k, f.singular_values.numel())


def unchanged_mask(w0: Matrix, w1: Matrix, eta: float = UNCHANGED_ETA) -> torch.Tensor:
    """[out, in] bool: entry unchanged iff |a - b| <= eta * max(|a|, |b|) after a bf16 round trip of both."""
    a, b = _weight(w0), _weight(w1)
    _check_same_shape(a, b)
    a = a.detach().to(torch.bfloat16).float()
    b = b.detach().to(a.device, torch.bfloat16).float()
    return (a - b).abs() <= eta * torch.maximum(a.abs(), b.abs())


def unchanged_fraction(w0: Matrix, w1: Matrix, eta: float = UNCHANGED_ETA) -> float:
    """Fraction of entries unchanged under the bf16-aware rule (`unchanged_mask`), in [0, 1]."""
    return unchanged_mask(w0, w1, eta).double().mean().item()


def principal_angles(w0: Matrix, w1: Matrix, k: int) -> PrincipalAngles:
    """Angles (degrees) between top-k singular subspaces: cos theta_i = sigma_i(U0k^T U1k), same for V.

    k is clamped to min(out, in).
    """
    f0, f1 = factor(w0), factor(w1)
    _check_same_shape(f0.weight, f1.weight)
    k = _clamp_rank(k, f0)

    def angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [n, k] orthonormal bases -> [k]
        cosines = torch.linalg.svdvals(a.T @ b).clamp(max=1.0)
        return torch.rad2deg(torch.arccos(cosines)).sort().values

    return PrincipalAngles(
        left=angles(f0.left[:, :k], f1.left[:, :k]),
        right=angles(f0.right_h[:k].T, f1.right_h[:k].T),
    )


def spectral_drift(w0: Matrix, w1: Matrix) -> float:
    """Normalized spectral shift ||sigma(w1) - sigma(w0)||_2 / ||sigma(w0)||_2."""
    f0, f1 = factor(w0), factor(w1)
    _check_same_shape(f0.weight, f1.weight)
    return (torch.linalg.vector_norm(f1.singular_values - f0.singular_values) / torch.linalg.vector_norm(f0.singular_values)).item()


def update_scale(delta: Matrix) -> float:
    """Frobenius norm ||delta||_F."""
    return torch.linalg.matrix_norm(_weight(delta).detach().double()).item()


def stable_rank(delta: Matrix) -> float:
    """||delta||_F^2 / ||delta||_2^2, in [1, min(out, in)]; NaN for a zero update."""
    s = factor(delta).singular_values
    if s[0] == 0:
        return math.nan
    return (s.square().sum() / s[0].square()).item()


def hill_tail_index(delta: Matrix, k: int) -> float:
    """Hill estimator on the top-k singular values: [ (1/(k-1)) sum_{i<k} log(s_i / s_k) ]^-1.

    k >= 2 and is clamped to min(out, in); NaN when s_k is numerically zero (update of rank < k), inf when
    the top-k are equal.
    """
    if k < 2:
        raise ValueError(f"the Hill estimator needs k >= 2, got {k}")
    f = factor(delta)
    k = _clamp_rank(k, f)
    s = f.singular_values[:k]
    if s[-1] <= s[0] * max(f.weight.shape) * torch.finfo(torch.float64).eps:
        return math.nan
    mean_log = torch.log(s[:-1] / s[-1]).mean().item()
    return math.inf if mean_log == 0 else 1.0 / mean_log


def top_right_vectors(matrix: Matrix, k: int) -> torch.Tensor:
    """[in, k] float64: the top-k right singular vectors (k clamped to min(out, in))."""
    f = factor(matrix)
    return f.right_h[: _clamp_rank(k, f)].T


def basis_overlap(v_a: torch.Tensor, v_b: torch.Tensor) -> float:
    """(1/K) ||v_a^T v_b||_F^2 for orthonormal bases [in, K]; 1 for equal spans, 0 for orthogonal ones."""
    _check_same_shape(v_a, v_b)
    return (torch.linalg.matrix_norm(v_a.T @ v_b).square() / v_a.shape[1]).item()


def subspace_similarity(delta_t: Matrix, delta_end: Matrix, k: int = 16) -> float:
    """Sim_K(t, t_end) = (1/K) ||V_K(t)^T V_K(t_end)||_F^2 of the updates' top-K right singular vectors."""
    return basis_overlap(top_right_vectors(delta_t, k), top_right_vectors(delta_end, k))


def _fraction_mask(scores: torch.Tensor, alpha: float, largest: bool) -> torch.Tensor:
    """Bool mask of the round(alpha * n) largest (or smallest) entries of `scores`."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    flat = scores.flatten()
    picked = torch.topk(flat, round(alpha * flat.numel()), largest=largest).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[picked] = True
    return mask.view_as(scores)


def mask_overlap(
    w0: Matrix,
    w1: Matrix,
    kind: Literal["principal", "low_magnitude"] = "principal",
    rank: int = 64,
    alpha: float = 0.5,
    eta: float = UNCHANGED_ETA,
) -> float:
    """|M & M_upd| / |M_upd|, where M_upd = entries changed by the unchanged rule and M is

    "principal": the top-alpha fraction of entries of |rank-`rank` SVD reconstruction of w0|;
    "low_magnitude": the bottom-alpha fraction of entries by |w0|.
    A random update gives alpha. NaN when nothing changed.
    """
    changed = ~unchanged_mask(w0, w1, eta)
    if kind == "principal":
        f0 = factor(w0)
        r = _clamp_rank(rank, f0)
        scores = ((f0.left[:, :r] * f0.singular_values[:r]) @ f0.right_h[:r]).abs()
        region = _fraction_mask(scores, alpha, largest=True)
    elif kind == "low_magnitude":
        region = _fraction_mask(_weight(w0).detach().abs(), alpha, largest=False)
    else:
        raise ValueError(f"unknown mask kind {kind!r}; choose one of {MASK_KINDS}")
    n_changed = changed.sum().item()
    if n_changed == 0:
        return math.nan
    return (region.to(changed.device) & changed).sum().item() / n_changed
