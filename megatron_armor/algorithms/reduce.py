"""Masked reductions shared by the losses."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """sum(values * mask) / (normalizer or sum(mask)); 0 (with the graph intact) for an empty mask.

    values, mask: [B, T] (mask float or bool) -> 0-dim float32.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum()
    if normalizer is not None:
        return total / normalizer
    return total / mask.sum().clamp(min=1.0)
