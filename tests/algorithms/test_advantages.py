"""GRPO advantages against a per-group loop with torch.std (unbiased)."""

import torch

from megatron_armor.algorithms import group_advantages


def naive(rewards, ids, eps=1e-6):
    out = torch.zeros_like(rewards)
    for g in ids.unique():
        sel = ids == g
        r = rewards[sel]
        out[sel] = 0.0 if len(r) == 1 else (r - r.mean()) / (r.std() + eps)
    return out


def test_matches_naive_with_shuffled_ids_and_singletons():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([7, 3, 7, 3, 3, 11, 7, 42])
    rewards = torch.randn(8, generator=g)
    assert torch.allclose(group_advantages(rewards, ids), naive(rewards, ids), atol=1e-6)
    assert group_advantages(rewards, ids)[7] == 0.0  # singleton group


def test_group_of_fifteen_plus_correct_anchor():
    # 15 on-policy (5 correct) + 1 correct anchor: 6 x (+1), 10 x (-1).
    rewards = torch.tensor([1.0] * 5 + [-1.0] * 10 + [1.0])
    adv = group_advantages(rewards, torch.zeros(16, dtype=torch.long))
    mean, std = -4 / 16, rewards.std().item()
    assert torch.allclose(adv[:5], torch.full((5,), (1 - mean) / (std + 1e-6)))
    assert torch.allclose(adv[5:15], torch.full((10,), (-1 - mean) / (std + 1e-6)))
    assert adv[15] == adv[0]  # the anchor is treated like any other sample
