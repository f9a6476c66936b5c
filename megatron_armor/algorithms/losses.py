"""Dual-clip PPO token losses: the ARMOR mixed-ratio loss (DAPO dual-clip PPO at alpha = 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_armor.algorithms.reduce import LossAggregation, aggregate_loss, masked_mean

MIXING_OFF_ALPHA = 1.0 - 1e-6
LOG_RATIO_CLAMP = 20.0


@dataclass
class ClippedTokens:
    """Per-token dual-clip PPO terms, all [B, T] float32 (flags bool).

    loss: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 at most -A * dual_clip;
    log_ratio: log r as given; ratio: r = exp(clamp(log_ratio, -20, 20)); clipped: the clipped
    branch is active; dual_clipped: the dual-clip bound is active (A < 0).
    """

    loss: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor

    @torch.no_grad()
    def stats(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Masked token means (detached 0-dim float32): clip_fraction, clip_fraction_lower (dual clip
        active), ppo_kl (k1 of the ratio), and num_tokens (count)."""
        m = mask.to(self.loss.dtype)
        return {
            "clip_fraction": masked_mean(self.clipped.to(m.dtype), m),
            "clip_fraction_lower": masked_mean(self.dual_clipped.to(m.dtype), m),
            "ppo_kl": masked_mean(-self.log_ratio, m),
            "num_tokens": m.sum(),
        }


def dual_clip_ppo(
    log_ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float, dual_clip: float
) -> ClippedTokens:
    """Per-token dual-clip PPO loss (to minimise) of `log_ratio` = log pi_theta - log pi_old. [B, T] -> [B, T]."""
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * dual_clip
    negative = advantages < 0
    return ClippedTokens(
        loss=torch.where(negative, torch.minimum(loss, dual_bound), loss),
        log_ratio=log_ratio,
        ratio=ratio,
        clipped=clipped > unclipped,
        dual_clipped=negative & (loss > dual_bound),
    )


def mixed_logprob(logp: torch.Tensor, ref_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """log(alpha * pi + (1 - alpha) * pi_ref), computed stably in log space. [B, T] -> [B, T]."""
    return torch.logaddexp(logp + math.log(alpha), ref_logp + math.log1p(-alpha))


def armor_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    alpha: float = 0.9375,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float = 10.0,
    aggregation: LossAggregation = "token_mean",
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ARMOR policy loss and its statistics.

    All tensors are [B, T] float32 (advantages per token, mask 1 on response tokens).
    The ratio is rho = exp(clamp(l_mix(theta) - l_mix(old), -20, 20)) with
    l_mix(x) = log(alpha * pi_x + (1 - alpha) * pi_ref); mixing is off for alpha >= 1 - 1e-6, where
    `ref_logp` may be None. Loss per token: `dual_clip_ppo`. Reduced by `aggregate_loss` with
    `aggregation` (default the token mean sum(L * mask) / sum(mask)); `normalizer` replaces the
    divisor (1 gives a micro-batch's partial sum for gradient accumulation). `token_weights` [B, T] (detached;
    None: 1) multiply each token's loss before the reduction (the behaviour correction of decoupled PPO).

    stats (detached 0-dim float32, masked token means): clip_fraction, clip_fraction_lower
    (dual clip active), mixed_ratio_mean, ppo_kl (k1 on mixed logprobs), num_tokens (count).
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if alpha >= MIXING_OFF_ALPHA:
        log_ratio = logp - old_logp
    else:
        if ref_logp is None:
            raise ValueError(f"ref_logp is required when alpha < 1 (got alpha={alpha})")
        log_ratio = mixed_logprob(logp, ref_logp, alpha) - mixed_logprob(old_logp, ref_logp, alpha)
    terms = dual_clip_ppo(log_ratio, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = terms.loss if token_weights is None else token_weights * terms.loss
    result = aggregate_loss(loss, mask, aggregation, normalizer)
    stats = terms.stats(mask)
    stats["mixed_ratio_mean"] = masked_mean(terms.ratio.detach(), mask.to(terms.ratio.dtype))
    return result, stats
