"""fused_armor_loss against armor_policy_loss on the eager torch reference logprobs."""

import pytest
import torch
from kernel_cases import DEVICE, assert_grad_close, make_case, pad_vocab, tolerances

from megatron_armor.kernels import fused_armor_loss
from megatron_armor.kernels.reference import reference_armor_loss

LOSS = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)  # a low dual clip so that it binds on some tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("alpha", "n", "v", "temperature", "padding"),
                         [(0.9375, 37, 1000, 0.7, 0), (1.0, 37, 1000, 1.0, 0), (0.5, 1, 1000, 1.0, 0),
                          (0.9375, 37, 1000, 0.7, 24)])
def test_matches_reference(dtype, alpha, n, v, temperature, padding):
    case = make_case(n, v, 64, dtype, seed=3)
    tol = tolerances(dtype)
    old_logp = case.old_logp - 3.0 * (torch.arange(n, device=DEVICE) % 3 == 0)  # ratios ~e^3 on a third: the dual clip binds
    rl_inputs = (old_logp, case.ref_logp, case.advantages, case.mask)
    hidden = case.hidden.clone().requires_grad_()
    weight = pad_vocab(case.weight, padding).requires_grad_()  # padding rows: Megatron's padded vocabulary
    loss, stats = fused_armor_loss(hidden, weight, case.labels, *rl_inputs, alpha=alpha, temperature=temperature,
                                   vocab_size=v, **LOSS)
    ref_hidden = case.hidden.float().requires_grad_()
    ref_weight = case.weight.float().requires_grad_()
    ref_loss, ref_stats = reference_armor_loss(ref_hidden, ref_weight, case.labels, *rl_inputs, alpha=alpha,
                                               temperature=temperature, **LOSS)

    torch.testing.assert_close(loss, ref_loss, atol=tol["forward"], rtol=0)
    assert set(stats) == set(ref_stats) | {"entropy"}
    for name, value in ref_stats.items():
        torch.testing.assert_close(stats[name], value, atol=tol["forward"], rtol=0, msg=name)
    if n > 1:  # the case exercises both clip branches and the dual clip
        assert 0 < stats["clip_fraction"] < 1 and stats["clip_fraction_lower"] > 0
    loss.backward()
    ref_loss.backward()
    assert_grad_close(hidden.grad, ref_hidden.grad, tol["grad"], "grad hidden")
    assert_grad_close(weight.grad[:v], ref_weight.grad, tol["grad"], "grad weight")
    assert (weight.grad[v:] == 0).all(), "padding rows got a gradient"


def test_normalizer_and_upstream_scale():
    case = make_case(37, 1000, 64, torch.float32, seed=4)
    rl_inputs = (case.old_logp, case.ref_logp, case.advantages, case.mask)
    weight = case.weight.clone().requires_grad_()
    loss, _ = fused_armor_loss(case.hidden, weight, case.labels, *rl_inputs, alpha=0.9375, normalizer=1.0, **LOSS)
    (3 * loss).backward()
    ref_weight = case.weight.clone().requires_grad_()
    ref_loss, _ = reference_armor_loss(case.hidden, ref_weight, case.labels, *rl_inputs, alpha=0.9375,
                                       normalizer=1.0, **LOSS)
    (3 * ref_loss).backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-6)
    assert_grad_close(weight.grad, ref_weight.grad, 1e-4, "grad weight")
