"""OPD per-token reverse-KL advantages (opd.md §1)."""

import pytest
import torch

from megatron_armor.algorithms import (
    armor_policy_loss, opd_token_advantages, reverse_kl, sparse_token_mask, sparsify_log_ratio,
)


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


R = torch.tensor([[0.5, -1.0, 2.0, 0.1, 9.0], [3.0, 1.0, -2.0, 0.0, 0.0]])  # r_t = old - teacher
R_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])  # T = 4 and 3


def test_top_sparsification_keeps_the_largest_r_per_response_and_rescales_by_t_over_kept():
    keep = sparse_token_mask(R, R_MASK, 0.5, "top")  # ceil(0.5 * 4) = 2, ceil(0.5 * 3) = 2; 9.0 is off-response
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0]]))
    sparse = sparsify_log_ratio(R, R_MASK, 0.5, "top")
    torch.testing.assert_close(sparse, torch.tensor([[1.0, 0.0, 4.0, 0.0, 0.0], [4.5, 1.5, 0.0, 0.0, 0.0]]))
    one = sparse_token_mask(R, R_MASK, 0.25, "top")  # ceil(1.0) = 1, ceil(0.75) = 1
    torch.testing.assert_close(one, torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]))
    assert sparse_token_mask(torch.zeros(1, 10), torch.ones(1, 10), 0.3, "top").sum() == 3  # not ceil(3.0000000000000004)
    assert sparsify_log_ratio(R, R_MASK, 1.0, "random") is R  # rho = 1 is off


def test_random_sparsification_keeps_ceil_rho_t_tokens_drawn_from_the_generator():
    r, mask = torch.zeros(64, 10), torch.ones(64, 10)
    mask[:, 8:] = 0.0
    keep = sparse_token_mask(r, mask, 0.25, "random", torch.Generator().manual_seed(0))
    assert torch.all(keep.sum(-1) == 2) and torch.all(keep[:, 8:] == 0)
    assert torch.equal(keep, sparse_token_mask(r, mask, 0.25, "random", torch.Generator().manual_seed(0)))
    assert not torch.equal(keep, sparse_token_mask(r, mask, 0.25, "random", torch.Generator().manual_seed(1)))
    assert (keep[:, :8].sum(0) > 0).all()  # every position is drawn somewhere (not just the first ones)
    with pytest.raises(ValueError, match="token fraction must be in"):
        sparse_token_mask(r, mask, 0.0, "top")
    with pytest.raises(ValueError, match="unknown token selection 'kl'"):
        sparse_token_mask(r, mask, 0.5, "kl")


def test_sparsified_advantages_are_minus_beta_times_the_rescaled_ratio():
    teacher = torch.zeros_like(R)
    adv = opd_token_advantages(R, teacher, R_MASK, beta=2.0, token_fraction=0.5, token_selection="top")
    torch.testing.assert_close(adv, -2.0 * sparsify_log_ratio(R, R_MASK, 0.5, "top"))
    mixed = opd_token_advantages(R, teacher, R_MASK, alpha=0.5, sequence_advantages=torch.tensor([1.0, -1.0]),
                                 token_fraction=0.5)
    torch.testing.assert_close(mixed[0], torch.tensor([0.0, 0.5, -1.5, 0.5, 0.0]))  # 0.5 * -(1, 0, 4, 0) + 0.5
