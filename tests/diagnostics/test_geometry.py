import math

import pytest
import torch

from megatron_armor.diagnostics import (
    factor, hill_tail_index, mask_overlap, principal_angles, spectral_drift, stable_rank, subspace_similarity,
    unchanged_fraction, update_scale,
)


def _orthonormal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def _from_svd(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (u[:, : s.numel()] * s) @ v[:, : s.numel()].T


def test_rank_one_update_has_stable_rank_one_and_known_values():
    a, b = torch.randn(24, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    assert stable_rank(torch.outer(a, b)) == pytest.approx(1.0, abs=1e-12)
    assert stable_rank(torch.diag(torch.tensor([4.0, 3.0]))) == pytest.approx(25 / 16)
    assert math.isnan(stable_rank(torch.zeros(3, 5)))
    delta = torch.randn(6, 9)
    assert update_scale(delta) == pytest.approx(delta.double().square().sum().sqrt().item())


def test_rotating_the_top_k_right_subspace_by_phi_reports_phi_degrees():
    m, n, k, phi = 24, 32, 4, 7.5
    u, v = _orthonormal(m, 0), _orthonormal(n, 1)
    s = torch.linspace(10.0, 1.0, m, dtype=torch.float64)
    c, sn = math.cos(math.radians(phi)), math.sin(math.radians(phi))
    rotated = v.clone()
    rotated[:, :k] = c * v[:, :k] + sn * v[:, k : 2 * k]
    rotated[:, k : 2 * k] = -sn * v[:, :k] + c * v[:, k : 2 * k]
    w0, w1 = _from_svd(u, s, v), _from_svd(u, s, rotated)

    angles = principal_angles(w0.float(), w1.float(), k)
    assert angles.right.tolist() == pytest.approx([phi] * k, abs=1e-2)
    assert angles.left.max().item() < 0.05
    exact = principal_angles(w0, w1, k)
    assert exact.right.tolist() == pytest.approx([phi] * k, abs=1e-6)
    assert principal_angles(w0, w1, 1000).right.numel() == m  # k clamped to min(out, in)
    assert spectral_drift(w0, w1) == pytest.approx(0.0, abs=1e-12)  # a rotation keeps the spectrum
    assert spectral_drift(w0, 1.1 * w0) == pytest.approx(0.1)


def test_changing_ten_percent_of_entries_reports_ninety_percent_unchanged():
    w0 = torch.randn(100, 50)
    w1 = w0.clone().view(-1)
    w1[torch.randperm(w1.numel())[: w1.numel() // 10]] *= 1.5
    assert unchanged_fraction(w0, w1.view(100, 50)) == pytest.approx(0.9)


def test_bf16_rounding_noise_alone_counts_as_unchanged():
    w0 = torch.randn(64, 48)
    assert unchanged_fraction(w0, w0.to(torch.bfloat16)) == 1.0  # fp32 master vs its bf16 copy
    exact = w0.to(torch.bfloat16).float()
    jitter = exact * (1 + 1e-4 * torch.randn_like(exact))  # below half a bf16 ulp
    assert unchanged_fraction(exact, jitter) == 1.0
    assert unchanged_fraction(exact, exact * 1.02) == 0.0


def test_subspace_similarity_is_one_for_itself_and_zero_for_orthogonal_updates():
    basis = _orthonormal(20, 2)
    delta_a = torch.randn(12, 4, dtype=torch.float64) @ basis[:, :4].T
    delta_b = torch.randn(12, 4, dtype=torch.float64) @ basis[:, 4:8].T
    assert subspace_similarity(delta_a, delta_a, k=4) == pytest.approx(1.0)
    assert subspace_similarity(delta_a, delta_b, k=4) == pytest.approx(0.0, abs=1e-12)
    delta_c = torch.randn(12, 2, dtype=torch.float64) @ basis[:, [0, 1]].T
    delta_d = torch.randn(12, 2, dtype=torch.float64) @ basis[:, [0, 4]].T
    assert subspace_similarity(delta_c, delta_d, k=2) == pytest.approx(0.5)  # one shared direction of two


def test_hill_tail_index_matches_the_formula():
    u, v = _orthonormal(6, 3), _orthonormal(5, 4)
    delta = _from_svd(u, torch.tensor([math.e**2, math.e, 1.0, 0.5], dtype=torch.float64), v)
    assert hill_tail_index(delta, 3) == pytest.approx(1 / 1.5)  # logs of s_i / s_3: 2 and 1
    rank_one = torch.outer(torch.randn(6, dtype=torch.float64), torch.randn(5, dtype=torch.float64))
    assert math.isnan(hill_tail_index(rank_one, 3))
    with pytest.raises(ValueError, match="k >= 2"):
        hill_tail_index(delta, 1)


def test_mask_overlap_on_a_constructed_update():
    w0 = torch.randn(16, 2, dtype=torch.float64) @ torch.randn(2, 16, dtype=torch.float64)  # rank 2 exactly
    order = w0.abs().flatten().argsort(descending=True)
    top, bottom = order[:128], order[128:]
    changed = torch.cat([top[:48], bottom[:16]])  # 3/4 of the update lies on the large entries
    w1 = w0.clone().view(-1)
    w1[changed] *= 2.0
    w1 = w1.view(16, 16)
    assert mask_overlap(w0, w1, "principal", rank=2, alpha=0.5) == pytest.approx(0.75)
    assert mask_overlap(w0, w1, "low_magnitude", alpha=0.5) == pytest.approx(0.25)
    assert math.isnan(mask_overlap(w0, w0.clone(), "low_magnitude"))
    with pytest.raises(ValueError, match="principal"):
        mask_overlap(w0, w1, "random")


def test_factored_inputs_give_the_same_answers_and_shapes_are_checked():
    w0, w1 = torch.randn(10, 8), torch.randn(10, 8)
    assert spectral_drift(factor(w0), factor(w1)) == pytest.approx(spectral_drift(w0, w1))
    assert unchanged_fraction(factor(w0), w1) == unchanged_fraction(w0, w1)
    with pytest.raises(ValueError, match=r"\(10, 8\) and \(8, 10\)"):
        spectral_drift(w0, w1.T)
    with pytest.raises(ValueError, match="2-D"):
        factor(torch.randn(3))
