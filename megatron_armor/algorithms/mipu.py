"""MIPU Step 2: the post-update inference-gap proxy, its tolerance schedule and the accept rule (mipu.md §3)."""

from __future__ import annotations

import torch


@torch.no_grad()
def gap_proxy(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
) -> float:
    """T_post = -mean_i(rho_i * A_i), rho_i = exp(mean_t(log pi_{k+1} - log mu_{k+1})) over response i.

    trainer_logp, engine_logp, mask: [N, T] float32 of N validation responses sampled by mu_{k+1};
    advantages: [N] float32, group-relative within each validation group. Negative T_post: the
    trainer favours positive-advantage responses more than the engine does.
    """
    lengths = mask.sum(1).clamp(min=1.0)
    rho = torch.exp(((trainer_logp - engine_logp) * mask).sum(1) / lengths)
    return float(-(rho * advantages).mean())


def tolerance(step: int, c_start: float, c_end: float, ramp_steps: int = 100) -> float:
    """c_t = c_start + min(t, ramp_steps) / ramp_steps * (c_end - c_start); constant after the ramp."""
    if ramp_steps <= 0:
        return c_end
    return c_start + min(step, ramp_steps) / ramp_steps * (c_end - c_start)


def accept_update(gap: float, c: float) -> bool:
    """Accept the candidate iff T_post >= -c."""
    return gap >= -c
