"""GRPO group-normalised outcome advantages, with a mean (GRPO) or quantile (QAE) baseline."""

from __future__ import annotations

from typing import Literal

import torch

ADVANTAGE_BASELINES = ("mean", "quantile")
AdvantageBaseline = Literal["mean", "quantile"]


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, baseline: AdvantageBaseline = "mean",
    quantile: float = 0.45,
) -> torch.Tensor:
    """A_i = (R_i - b_g) / (std_g + eps) with torch's unbiased std over each group g.

    b_g is the group's mean ("mean", GRPO) or its `quantile` ("quantile", QAE, armor.md §2:
    torch.quantile with linear interpolation); the std is the one about the mean either way.
    rewards: [N] float32; group_ids: [N] int64, arbitrary ids -> [N] float32.
    A singleton group has no defined std; its advantage is 0 (it carries no learning signal).
    """
    if baseline not in ADVANTAGE_BASELINES:
        raise ValueError(f"unknown advantage baseline {baseline!r}; choose one of {ADVANTAGE_BASELINES}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards = rewards.to(torch.float32)
    n = counts.to(torch.float32)
    means = torch.zeros(len(counts)).index_add_(0, inverse, rewards) / n
    sq = torch.zeros(len(counts)).index_add_(0, inverse, (rewards - means[inverse]).square())
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    if baseline == "quantile":
        base = torch.stack([torch.quantile(rewards[inverse == g], quantile) for g in range(len(counts))])
    else:
        base = means
    advantages = (rewards - base[inverse]) / (std[inverse] + eps)
    return torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages))
