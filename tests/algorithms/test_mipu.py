"""MIPU math: sampler-referenced Step-1 loss, Mismatch-K3, gap proxy, tolerance schedule (mipu.md §6)."""

import math

import pytest
import torch

from megatron_armor.algorithms import (
    accept_update, gap_proxy, mismatch_k3, sampler_corrected_loss, sampler_weights, tolerance,
)


def _naive_step1(logp, old, engine, adv, mask, correction, w_max=2.0, eps=0.2):
    """-J_S1 written straight from the spec, token by token (the reference for values and gradients):
    -(1/G) sum_i (1/T_i) sum_t wbar_it l_dc_it."""
    per_response = []
    for b in range(logp.shape[0]):
        total, length = 0.0, 0
        for t in range(logp.shape[1]):
            if mask[b, t] == 0:
                continue
            w = math.exp(float(old[b, t] - engine[b, t]))
            wbar = {"tis": min(w, w_max), "mis": float(w <= w_max), "none": 1.0}[correction]
            r = torch.exp(logp[b, t] - old[b, t])
            a = float(adv[b, t])
            l_clip = torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
            l_dc = l_clip if a >= 0 else torch.maximum(l_clip, torch.tensor((1 + 2 * eps) * a))
            total, length = total + wbar * l_dc, length + 1
        per_response.append(total / length)
    return -sum(per_response) / len(per_response)


@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_step1_loss_and_gradient_match_the_spec_formula(correction):
    g = torch.Generator().manual_seed(0)
    shape = (3, 7)
    old = -torch.rand(shape, generator=g) * 3
    engine = old + torch.randn(shape, generator=g)  # w spans both sides of w_max = 2
    logp = (old + 0.5 * torch.randn(shape, generator=g)).requires_grad_()  # ratios beyond 1 +- 0.2 and 1.4
    adv = torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.2).float()
    mask[:, 0] = 1.0  # every response has a token
    mask[0, 4:] = 0.0  # and their lengths differ, so a token mean would weigh them differently
    loss, stats = sampler_corrected_loss(logp, old, engine, adv, mask, correction=correction)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_()
    expected = _naive_step1(logp_ref, old, engine, adv, mask, correction)
    (grad_ref,) = torch.autograd.grad(expected, logp_ref)
    torch.testing.assert_close(loss, expected.to(loss.dtype))
    torch.testing.assert_close(grad, grad_ref)
    assert 0 < float(stats["clip_fraction"]) < 1 and 0 < float(stats["clip_fraction_lower"]) < 1
    assert 0 < float(stats["is_truncated_fraction"]) < 1


def test_truncated_weights_cap_at_w_max_and_carry_no_gradient():
    old = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    engine = torch.tensor([[0.0, -math.log(1.5), -5.0]])  # w = 1, 1.5, e^5
    tis = sampler_weights(old, engine, "tis", w_max=2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 1.5, 2.0]]))
    assert not tis.requires_grad
    torch.testing.assert_close(sampler_weights(old, engine, "mis"), torch.tensor([[1.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="unknown importance correction 'ppo'"):
        sampler_weights(old, engine, "ppo")


def test_dual_clip_bounds_negative_advantage_at_one_plus_two_eps():
    zeros = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(3.0), requires_grad=True)  # r = 3, beyond 1 + eps and 1 + 2 eps
    loss, stats = sampler_corrected_loss(logp, zeros, zeros, -torch.ones(1, 1), torch.ones(1, 1), correction="none")
    assert float(loss.detach()) == pytest.approx(1.4)  # -max(min(-3, -1.2), -1.4) = 1.4
    assert float(stats["clip_fraction_lower"]) == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert float(grad) == 0.0


def test_mismatch_k3_is_zero_for_equal_policies_and_matches_its_formula():
    mask = torch.ones(1, 2)
    assert float(mismatch_k3(torch.zeros(1, 2), torch.zeros(1, 2), mask)) == 0.0
    d = torch.tensor([[0.1, -0.3]])
    expected = float((d.exp() - d - 1).mean())
    assert float(mismatch_k3(d, torch.zeros(1, 2), mask)) == pytest.approx(expected)


def test_gap_proxy_is_zero_when_engines_agree_and_accepts_for_nonnegative_tolerance():
    lp = -torch.rand(4, 5)
    mask = torch.ones(4, 5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    assert gap_proxy(lp, lp, mask, adv) == 0.0
    assert accept_update(0.0, 0.0) and accept_update(0.0, 1e-3)


def test_trainer_favouring_positive_advantage_responses_gives_negative_gap_and_a_reject():
    engine = torch.full((2, 4), -1.0)
    trainer = engine.clone()
    trainer[0] += 0.2  # the trainer likes the good response more than the engine does
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    gap = gap_proxy(trainer, engine, mask, adv)
    assert gap == pytest.approx(-(math.exp(0.2) - 1.0) / 2)  # rho = (e^0.2, 1)
    assert not accept_update(gap, 1e-3) and accept_update(gap, 0.2)


def test_tolerance_schedule_endpoints():
    assert tolerance(0, 4e-3, 1e-3) == 4e-3
    assert tolerance(50, 4e-3, 1e-3) == pytest.approx(2.5e-3)
    assert tolerance(100, 4e-3, 1e-3) == pytest.approx(1e-3)
    assert tolerance(800, 4e-3, 1e-3) == pytest.approx(1e-3)
    assert tolerance(5, 4e-3, 1e-3, ramp_steps=0) == 1e-3


def test_gap_proxy_clamps_the_log_ratio_like_the_sampler_weights():
    """One -inf engine logprob counts as a log ratio of +20 (LOG_RATIO_CLAMP), not as an infinite rho;
    off-response positions are ignored whatever they hold."""
    trainer = torch.zeros(2, 3)
    engine = torch.tensor([[-math.inf, 0.0, 0.0], [0.0, 0.0, -math.inf]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    rho = torch.tensor([math.exp(20.0 / 3), 1.0])  # response 0: (20 + 0 + 0) / 3; response 1: the -inf is masked out
    assert gap_proxy(trainer, engine, mask, adv) == pytest.approx(float(-(rho * adv).mean()), rel=1e-6)


def test_gap_proxy_raises_on_a_non_finite_gap_instead_of_rejecting_silently():
    mask = torch.ones(2, 2)
    trainer = torch.tensor([[math.nan, -1.0], [-1.0, -1.0]])
    with pytest.raises(FloatingPointError, match="gap proxy T_post is nan"):
        gap_proxy(trainer, torch.full((2, 2), -1.0), mask, torch.tensor([1.0, -1.0]))


def test_gap_proxy_counts_a_trajectory_forked_into_responses_once():
    """Responses 0 and 1 are one trajectory's two segments (advantage 1 each), response 2 a trajectory alone: the
    first trajectory's rho is over its segments' three tokens, and the mean is over two trajectories."""
    trainer = torch.tensor([[0.3, 0.0], [0.6, 0.9], [0.2, 0.0]])
    engine = torch.zeros(3, 2)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    rho = [math.exp((0.3 + 0.6 + 0.9) / 3), math.exp(0.2)]
    gap = gap_proxy(trainer, engine, mask, adv, trajectories=torch.tensor([0, 0, 1]))
    assert gap == pytest.approx(-(rho[0] - rho[1]) / 2, rel=1e-6)
    assert gap_proxy(trainer, engine, mask, adv) == pytest.approx(
        -(math.exp(0.3) + math.exp(0.75) - math.exp(0.2)) / 3, rel=1e-6)  # each response its own trajectory
