"""OPD per-token reverse-KL advantages (opd.md §1)."""

import pytest
import torch

from megatron_armor.algorithms import armor_policy_loss, opd_token_advantages, reverse_kl


def test_pure_opd_advantage_is_minus_beta_times_log_ratio_on_response_tokens():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = opd_token_advantages(old, teacher, mask, beta=2.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -2.0, 0.0]]))
    assert float(reverse_kl(old, teacher, mask)) == pytest.approx(0.25)  # mean(-0.5, 1.0)


def test_mixing_adds_the_broadcast_sequence_advantage():
    old, teacher, mask = torch.zeros(2, 2), torch.full((2, 2), -1.0), torch.ones(2, 2)
    adv = opd_token_advantages(old, teacher, mask, alpha=0.25, sequence_advantages=torch.tensor([2.0, -2.0]))
    torch.testing.assert_close(adv, torch.tensor([[1.25, 1.25], [-1.75, -1.75]]))  # 0.25 * -1 + 0.75 * +-2
    with pytest.raises(ValueError, match="sequence_advantages are required"):
        opd_token_advantages(old, teacher, mask, alpha=0.5)


def test_opd_gradient_pushes_student_towards_teacher_tokens():
    """On-policy (logp = old), the clipped loss gradient is -A_t / n: up where the teacher likes the token more."""
    old = torch.tensor([[-2.0, -0.1]])
    teacher = torch.tensor([[-0.5, -3.0]])
    mask = torch.ones(1, 2)
    adv = opd_token_advantages(old, teacher, mask)
    logp = old.clone().requires_grad_()
    loss, _ = armor_policy_loss(logp, old, None, adv, mask, alpha=1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -adv / 2)
    assert grad[0, 0] < 0 < grad[0, 1]
