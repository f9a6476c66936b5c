"""GRPO advantages against a per-group loop with torch.std (unbiased); the QAE quantile baseline by hand."""

import math

import pytest
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


def test_quantile_baseline_matches_a_hand_computation():
    """QAE (armor.md §2): b = torch.quantile(R, 0.45) with linear interpolation, std unchanged.

    Group 0, R = (1, -1, -1, 1, 1) sorted (-1, -1, 1, 1, 1): position 0.45 * 4 = 1.8 lies between
    -1 (index 1) and 1 (index 2), so b = -1 + 0.8 * 2 = 0.6; mean 0.2, unbiased std
    sqrt((3 * 0.8^2 + 2 * 1.2^2) / 4) = sqrt(1.2). Group 1, R = (0, 3): b = 0.45 * 3 = 1.35, std sqrt(4.5).
    """
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 3.0])
    ids = torch.tensor([0, 0, 0, 0, 0, 5, 5])
    adv = group_advantages(rewards, ids, eps=0.0, baseline="quantile", quantile=0.45)
    std0, std1 = math.sqrt(1.2), math.sqrt(4.5)
    expected = [(r - 0.6) / std0 for r in (1, -1, -1, 1, 1)] + [(0 - 1.35) / std1, (3 - 1.35) / std1]
    torch.testing.assert_close(adv, torch.tensor(expected))
    mean_adv = group_advantages(rewards, ids, eps=0.0)  # same std: the two differ by (mean - b) / std
    torch.testing.assert_close(adv - mean_adv, torch.tensor([-0.4 / std0] * 5 + [0.15 / std1] * 2))
    with pytest.raises(ValueError, match="unknown advantage baseline 'median'"):
        group_advantages(rewards, ids, baseline="median")
