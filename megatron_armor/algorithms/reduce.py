"""Masked reductions shared by the losses, and the loss aggregation modes.

A policy loss is a per-token tensor L [B, T] reduced to a scalar. Two aggregations are offered:
- "token_mean": sum_{i,t} m_it L_it / N_tok, one weight per response token;
- "seq_mean_token_mean": sum_i (1/T_i) sum_t m_it L_it / N_seq, a per-sequence token mean and then
  a mean over sequences (T_i = sum_t m_it; mipu.md §2's J_S1), one weight per sequence.
Under micro-batching and data/pipeline parallelism the trainer sums each micro-batch's numerator
(normalizer 1) and divides by the global count of units (`aggregation_units`: tokens or sequences),
which reproduces the whole-batch value exactly.
"""

from __future__ import annotations

from typing import Literal

import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
LossAggregation = Literal["token_mean", "seq_mean_token_mean"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """sum(values * mask) / (normalizer or sum(mask)); 0 (with the graph intact) for an empty mask.

    values, mask: [B, T] (mask float or bool) -> 0-dim float32.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum()
    if normalizer is not None:
        return total / normalizer
    return total / mask.sum().clamp(min=1.0)


def check_aggregation(aggregation: str) -> None:
    """ValueError unless `aggregation` is one of `LOSS_AGGREGATIONS`."""
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {LOSS_AGGREGATIONS}")


def aggregation_units(mask: torch.Tensor, aggregation: LossAggregation) -> torch.Tensor:
    """The count `aggregate_loss` divides by: response tokens (token_mean) or sequences holding at
    least one response token (seq_mean_token_mean). mask: [B, T] -> 0-dim float32."""
    check_aggregation(aggregation)
    mask = mask.float()
    if aggregation == "token_mean":
        return mask.sum()
    return (mask.sum(-1) > 0).float().sum()


def aggregate_loss(
    values: torch.Tensor, mask: torch.Tensor, aggregation: LossAggregation,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` [B, T] over the response `mask` [B, T] -> 0-dim float32.

    token_mean: sum_{i,t} m_it v_it / N; seq_mean_token_mean: sum_i (1/T_i) sum_t m_it v_it / N.
    N = `normalizer` when given (1 gives the partial sum of a micro-batch), else
    `aggregation_units(mask)`; an empty mask gives 0 with the graph intact.
    """
    check_aggregation(aggregation)
    if aggregation == "seq_mean_token_mean":
        values = values / mask.to(values.dtype).sum(-1, keepdim=True).clamp(min=1.0)  # [B, T] / [B, 1]
    if normalizer is None:
        normalizer = aggregation_units(mask, aggregation).clamp(min=1.0)
    return masked_mean(values, mask, normalizer)
