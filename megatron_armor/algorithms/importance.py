"""MIPU Step 1: the sampler-referenced policy loss (mipu.md §2) and the Mismatch-K3 diagnostic.

The rollout engine mu_k samples; the trainer's old policy pi_k scores the same tokens. Per token
  w    = pi_k / mu_k = exp(old_logp - engine_logp)          (stop-gradient)
  tis: wbar = min(w, w_max); mis: wbar = 1[w <= w_max]; none: wbar = 1
  loss = wbar * dual_clip_ppo(log pi_theta - log pi_k, A)    (only pi_theta / pi_k is clipped)
The spec's dual-clip bound (1 + 2 eps) * A is the `dual_clip` argument (1.4 for eps = 0.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_armor.algorithms.losses import LOG_RATIO_CLAMP, dual_clip_ppo
from megatron_armor.algorithms.reduce import LossAggregation, aggregate_loss, masked_mean

IS_CORRECTIONS = ("tis", "mis", "none")
ISCorrection = Literal["tis", "mis", "none"]


@torch.no_grad()
def sampler_weights(
    old_logp: torch.Tensor, engine_logp: torch.Tensor, correction: ISCorrection, w_max: float = 2.0
) -> torch.Tensor:
    """Per-token importance weights of the trainer's old policy against the sampler. [B, T] -> [B, T].

    tis: min(w, w_max) (truncated IS); mis: 1[w <= w_max] (masked IS); none: 1. No gradient flows.
    """
    if correction not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance correction {correction!r}; choose one of {IS_CORRECTIONS}")
    w = torch.exp((old_logp - engine_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if correction == "tis":
        return w.clamp(max=w_max)
    if correction == "mis":
        return (w <= w_max).to(old_logp.dtype)
    return torch.ones_like(w)


@dataclass(frozen=True)
class SamplerWeights:
    """Per-token importance weights of the trainer's old policy against the sampler, and their statistics."""

    weights: torch.Tensor  # [B, T] float32, `sampler_weights`
    mean: torch.Tensor  # 0-dim: masked token mean of the weights
    truncated_fraction: torch.Tensor  # 0-dim: masked fraction of tokens whose raw weight exceeds w_max


@torch.no_grad()
def corrected_weights(
    old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, correction: ISCorrection, w_max: float,
    corrected_rows: torch.Tensor | None = None,
) -> SamplerWeights:
    """`sampler_weights` of [B, T] logprobs with their masked statistics (mask: [B, T], 1 on response tokens).

    corrected_rows [B] bool (None: all): the rows whose sampler may differ from the old policy; the others weigh 1
    and count as not truncated (ARMOR's anchors: their sampler, the frozen reference, is not the policy pi_old). The
    statistics are over every response token, as the loss applies the weights (and as the trainer averages token
    means over micro-batches: by their response tokens).
    """
    weights = sampler_weights(old_logp, engine_logp, correction, w_max)
    truncated = (old_logp - engine_logp) > torch.log(torch.tensor(w_max, dtype=old_logp.dtype))
    if corrected_rows is not None:
        weights = torch.where(corrected_rows[:, None], weights, torch.ones_like(weights))
        truncated = truncated & corrected_rows[:, None]
    m = mask.to(old_logp.dtype)
    return SamplerWeights(weights, masked_mean(weights, m), masked_mean(truncated.to(old_logp.dtype), m))


def sampler_corrected_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: ISCorrection = "tis",
    w_max: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 1.4,
    aggregation: LossAggregation = "seq_mean_token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MIPU Step-1 loss (-J_S1) and its statistics.

    logp (differentiable), old_logp, engine_logp, advantages (per token), mask: [B, T] float32.
    Reduced by `aggregate_loss`: by default the spec's mean over sequences of per-sequence token
    means, sum_i (1/T_i) sum_t wbar L / #sequences; `normalizer` replaces the divisor (1 gives a
    micro-batch's partial sum).
    stats (detached 0-dim, masked token means): clip_fraction, clip_fraction_lower, is_weight_mean,
    is_truncated_fraction (tokens with w > w_max), ppo_kl, num_tokens (count).
    """
    weights = corrected_weights(old_logp, engine_logp, mask, correction, w_max)
    log_ratio = logp - old_logp
    terms = dual_clip_ppo(log_ratio, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    result = aggregate_loss(weights.weights * terms.loss, mask, aggregation, normalizer)
    stats = terms.stats(mask)
    stats["is_weight_mean"], stats["is_truncated_fraction"] = weights.mean, weights.truncated_fraction
    return result, stats


@torch.no_grad()
def mismatch_k3(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mismatch-K3 (mipu.md §5): d = log pi - log mu on engine-sampled tokens, mean(exp(d) - d - 1),
    an estimate of KL(mu || pi). [B, T] float32 -> 0-dim float32."""
    d = (trainer_logp - engine_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return masked_mean(d.exp() - d - 1.0, mask)
