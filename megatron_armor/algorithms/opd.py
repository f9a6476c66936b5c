"""On-policy distillation (opd.md §1): per-token reverse-KL advantages against a frozen teacher."""

from __future__ import annotations

import torch

from megatron_armor.algorithms.reduce import masked_mean


@torch.no_grad()
def opd_token_advantages(
    old_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    sequence_advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_t = alpha * (-beta * r_t) + (1 - alpha) * A_seq, r_t = old_logp - teacher_logp (detached).

    old_logp, teacher_logp, mask: [B, T] float32 (student at rollout time, teacher, response mask);
    sequence_advantages: [B] float32 GRPO advantages broadcast over tokens (needed when alpha < 1).
    alpha = 1 is pure OPD (A_base = 0). Returns [B, T] float32, 0 off-response.
    """
    advantages = -beta * (old_logp - teacher_logp)
    if alpha < 1.0:
        if sequence_advantages is None:
            raise ValueError(f"sequence_advantages are required to mix OPD with GRPO (alpha={alpha} < 1)")
        advantages = alpha * advantages + (1.0 - alpha) * sequence_advantages[:, None]
    return advantages * mask


@torch.no_grad()
def reverse_kl(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Single-sample reverse KL(student || teacher): token mean of old_logp - teacher_logp. [B, T] -> 0-dim."""
    return masked_mean(old_logp - teacher_logp, mask)
