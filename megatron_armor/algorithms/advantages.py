"""GRPO group-normalised outcome advantages."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (R_i - mean_g) / (std_g + eps) with torch's unbiased std over each group g.

    rewards: [N] float32; group_ids: [N] int64, arbitrary ids -> [N] float32.
    A singleton group has no defined std; its advantage is 0 (it carries no learning signal).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards = rewards.to(torch.float32)
    n = counts.to(torch.float32)
    sums = torch.zeros(len(counts)).index_add_(0, inverse, rewards)
    means = sums / n
    centered = rewards - means[inverse]
    sq = torch.zeros(len(counts)).index_add_(0, inverse, centered.square())
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    advantages = centered / (std[inverse] + eps)
    return torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages))
