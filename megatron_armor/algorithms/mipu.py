"""MIPU Step 2: the post-update inference-gap proxy, its tolerance schedule and the accept rule (mipu.md §3)."""

from __future__ import annotations

import math

import torch

from megatron_armor.algorithms.losses import LOG_RATIO_CLAMP


@torch.no_grad()
def gap_proxy(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
) -> float:
    """T_post = -mean_i(rho_i * A_i), rho_i = exp(mean_t(log pi_{k+1} - log mu_{k+1})) over response i.

    trainer_logp, engine_logp, mask: [N, T] float32 of N validation responses sampled by mu_{k+1};
    advantages: [N] float32, group-relative within each validation group. Negative T_post: the
    trainer favours positive-advantage responses more than the engine does. Each token's log ratio
    is clamped to +-LOG_RATIO_CLAMP (as in `sampler_weights`), so an engine logprob of -inf counts
    as a large finite ratio; a non-finite T_post (NaN logprobs or advantages) raises FloatingPointError
    instead of silently failing `accept_update`.
    """
    log_ratio = (trainer_logp - engine_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = torch.where(mask > 0, log_ratio, 0.0)  # off-response positions may hold anything
    rho = torch.exp(log_ratio.sum(1) / mask.sum(1).clamp(min=1.0))
    gap = float(-(rho * advantages).mean())
    if not math.isfinite(gap):
        raise FloatingPointError(
            f"MIPU gap proxy T_post is {gap}: the gate batch has non-finite trainer/engine logprobs or advantages"
        )
    return gap


def tolerance(step: int, c_start: float, c_end: float, ramp_steps: int = 100) -> float:
    """c_t = c_start + min(t, ramp_steps) / ramp_steps * (c_end - c_start); constant after the ramp."""
    if ramp_steps <= 0:
        return c_end
    return c_start + min(step, ramp_steps) / ramp_steps * (c_end - c_start)


def accept_update(gap: float, c: float) -> bool:
    """Accept the candidate iff T_post >= -c."""
    return gap >= -c
