"""KL-to-reference estimators (Schulman's k1, k2, k3) for the GRPO + KL baseline."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi. [B, T] float32 -> [B, T].

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1, with the log
    difference clamped to [-20, 20] and the result to [-10, 10] (verl's low_var_kl) for stability.
    """
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        reverse = (-diff).clamp(-20.0, 20.0)
        return (reverse.exp() - reverse - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
