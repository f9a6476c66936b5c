"""ARMOR loss against hand computations and an independent naive float64 implementation."""

import math

import pytest
import torch

from megatron_armor.algorithms import armor_policy_loss


def naive_token_loss(l, l_old, l_ref, a, alpha, eps_low=0.2, eps_high=0.28, c=10.0):
    """Direct transcription of the spec for one token, with python floats."""
    if alpha >= 1 - 1e-6:
        log_ratio = l - l_old
    else:
        mix = lambda x: math.log(alpha * math.exp(x) + (1 - alpha) * math.exp(l_ref))  # noqa: E731
        log_ratio = mix(l) - mix(l_old)
    rho = math.exp(min(max(log_ratio, -20.0), 20.0))
    loss = max(-a * rho, -a * min(max(rho, 1 - eps_low), 1 + eps_high))
    if a < 0:
        loss = min(loss, -a * c)
    return loss


def _random_case(seed, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + torch.randn(b, t, generator=g) * 0.4
    ref = old + torch.randn(b, t, generator=g) * 0.8
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("alpha", [1.0, 0.9375, 0.5])
def test_matches_naive_per_token_formula(alpha):
    logp, old, ref, adv, mask = _random_case(0)
    loss, _ = armor_policy_loss(logp, old, ref, adv, mask, alpha=alpha)
    expected = [
        naive_token_loss(logp[i, j].item(), old[i, j].item(), ref[i, j].item(), adv[i, j].item(), alpha)
        for i in range(3) for j in range(5) if mask[i, j]
    ]
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-5, abs=1e-6)


def test_hand_computed_tokens():
    # Token 1: alpha=0.5, pi=0.5, pi_old=0.25, pi_ref=0.25 -> rho = (0.25+0.125)/(0.125+0.125) = 1.5,
    #          A=+1 -> clipped at 1.28 -> loss -1.28 (clip active).
    # Token 2: same probabilities, A=-2 -> max(-A*1.5, -A*1.28) = 3.0 (unclipped, below c*|A|=20).
    # Token 3: pi=pi_old -> rho = 1, A=+0.5 -> loss -0.5.
    l = torch.log(torch.tensor([[0.5, 0.5, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.25, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.9]]))
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    loss, stats = armor_policy_loss(l, old, ref, adv, torch.ones(1, 3), alpha=0.5)
    assert loss.item() == pytest.approx((-1.28 + 3.0 - 0.5) / 3, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)
    assert stats["mixed_ratio_mean"].item() == pytest.approx((1.5 + 1.5 + 1.0) / 3, rel=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    l, old = torch.tensor([[0.0, 0.0]]), torch.tensor([[-5.0, -5.0]])  # rho = e^5 ~ 148
    adv = torch.tensor([[-1.0, 1.0]])
    loss, stats = armor_policy_loss(l, old, None, adv, torch.ones(1, 2), alpha=1.0)
    # A<0: min(max(148, 1.28)*1, 10) = 10; A>0: max(-148, -1.28) = -1.28.
    assert loss.item() == pytest.approx((10.0 - 1.28) / 2, rel=1e-6)
    assert stats["clip_fraction_lower"].item() == pytest.approx(0.5)


def test_gradient_matches_autograd_of_naive_float64_formula():
    logp, old, ref, adv, mask = _random_case(1)
    alpha = 0.9375
    x = logp.clone().requires_grad_(True)
    armor_policy_loss(x, old, ref, adv, mask, alpha=alpha)[0].backward()
    y = logp.double().clone().requires_grad_(True)
    mix = lambda v: torch.log(alpha * torch.exp(v) + (1 - alpha) * torch.exp(ref.double()))  # noqa: E731
    rho = torch.exp((mix(y) - mix(old.double())).clamp(-20, 20))
    a = adv.double()
    token = torch.maximum(-a * rho, -a * rho.clamp(0.8, 1.28))
    token = torch.where(a < 0, torch.minimum(token, -a * 10.0), token)
    ((token * mask).sum() / mask.sum()).backward()
    assert torch.allclose(x.grad.double(), y.grad, atol=1e-6)


def test_normalizer_and_empty_mask():
    logp, old, ref, adv, mask = _random_case(2)
    mean_loss, _ = armor_policy_loss(logp, old, ref, adv, mask)
    sum_loss, _ = armor_policy_loss(logp, old, ref, adv, mask, normalizer=1.0)
    assert sum_loss.item() == pytest.approx(mean_loss.item() * mask.sum().item(), rel=1e-5)
    x = logp.clone().requires_grad_(True)
    empty, stats = armor_policy_loss(x, old, ref, adv, torch.zeros_like(mask))
    empty.backward()
    assert empty.item() == 0.0 and torch.all(x.grad == 0) and stats["num_tokens"].item() == 0


@pytest.mark.parametrize("alpha", [1.0, 0.9375])
def test_stable_at_extreme_logprobs(alpha):
    l = torch.full((2, 3), -80.0, requires_grad=True)
    old = torch.tensor([[-80.0, -1.0, -79.0], [-0.5, -80.0, -3.0]])
    ref = torch.tensor([[-1.0, -80.0, -80.0], [-80.0, -2.0, -80.0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    loss, _ = armor_policy_loss(l, old, ref, adv, torch.ones(2, 3), alpha=alpha)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(l.grad).all()
    expected = [naive_token_loss(-80.0, old[i, j].item(), ref[i, j].item(), adv[i, j].item(), alpha)
                for i in range(2) for j in range(3)]
    assert loss.item() == pytest.approx(sum(expected) / 6, rel=1e-5)


def test_loss_and_clip_fraction_equal_the_adaptive_clip_on_the_plain_ratio():
    """Spec section 3: with w = a pi_old / (a pi_old + (1-a) pi_ref) and r = pi/pi_old, rho = w r + (1 - w),
    and clipping rho to [1-e_l, 1+e_h] is clipping r to [1 - e_l/w, 1 + e_h/w]. The package's loss and
    clip fraction must equal that formula, written on r with no mixed ratio at all."""
    logp, old, ref, adv, mask = _random_case(3, b=6, t=8)
    logp = old + (logp - old) * 4  # ratios far enough from 1 that both clip bounds bind on some tokens
    alpha, c = 0.875, 10.0
    w = alpha * old.exp() / (alpha * old.exp() + (1 - alpha) * ref.exp())
    r = (logp - old).exp()
    positive = adv > 0
    r_clip = torch.where(positive, torch.minimum(r, 1 + 0.28 / w), torch.maximum(r, 1 - 0.2 / w))
    token = -adv * (w * r_clip + 1 - w)  # max(-A rho, -A clip(rho)) is -A times the clipped side's ratio
    token = torch.where(positive, token, torch.minimum(token, -adv * c))
    clipped = r_clip != r
    loss, stats = armor_policy_loss(logp, old, ref, adv, mask, alpha=alpha)
    assert 0 < float((clipped * mask).sum()) < float(mask.sum())  # the case exercises both branches
    assert loss.item() == pytest.approx(float((token * mask).sum() / mask.sum()), rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(float((clipped * mask).sum() / mask.sum()))
    rho = w * r + (1 - w)
    assert stats["mixed_ratio_mean"].item() == pytest.approx(float((rho * mask).sum() / mask.sum()), rel=1e-5)
