"""Independent references on the HF model for the tests that run Megatron's losses and optimizer.

Nothing here imports megatron_armor: logprobs come from unpadded HF forward passes of each sample,
the ARMOR loss is transcribed from /work/shared/spec/armor.md §3, advantages from §2 and the optimizer
from §6 (torch.optim.AdamW + torch.nn.utils.clip_grad_norm_).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# fp32 Megatron against an HF reference: the forward and backward sums run in a different order (and in
# float64 on the reference side for ARMOR), which moves gradients by ~1e-6 relative; cancellations
# leave a few entries near zero, hence the small absolute floor.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7


def assert_same_grads(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same HF parameter names, and every gradient within GRAD_RTOL / GRAD_ATOL (compared in float32)."""
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name].to(grad.dtype), rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def response_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log pi(response_j | prompt, response_<j) of one unpadded sequence: [len(response)] (differentiable).

    Logits at position t predict token t + 1, so response token j (at position P + j) is read at P + j - 1.
    """
    tokens = torch.tensor(prompt + response)[None]
    logp = torch.log_softmax(model(tokens).logits[0].double(), dim=-1)
    start = len(prompt) - 1
    return logp[start : start + len(response)].gather(-1, torch.tensor(response)[:, None])[:, 0]


def grpo_advantages(rewards: list[float], groups: list[int], eps: float = 1e-6) -> list[float]:
    """armor.md §2, one group at a time: (R - mean) / (unbiased std + eps), in python floats."""
    advantages = [0.0] * len(rewards)
    for group in sorted(set(groups)):
        members = [i for i, g in enumerate(groups) if g == group]
        values = [rewards[i] for i in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((r - mean) ** 2 for r in values) / (len(values) - 1))
        for i in members:
            advantages[i] = (rewards[i] - mean) / (std + eps)
    return advantages


@dataclass
class ArmorTokens:
    """One response's ARMOR terms, all [R] float64: the loss to minimise, the mixed ratio rho, and
    whether the PPO clip binds (A > 0 above 1 + clip_high, A < 0 below 1 - clip_low) or the dual clip does."""

    loss: torch.Tensor
    rho: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def armor_tokens(logp, old, ref, advantage: float, *, alpha, clip_low, clip_high, dual_clip) -> ArmorTokens:
    """armor.md §3 for one response: logsumexp mixing with the reference, clamp +-20, dual-clip PPO."""

    def mixed(x):  # log(alpha * pi_x + (1 - alpha) * pi_ref)
        return torch.logsumexp(torch.stack([x + math.log(alpha), ref + math.log(1 - alpha)]), dim=0)

    rho = torch.exp((mixed(logp) - mixed(old)).clamp(-20.0, 20.0))
    a = advantage
    loss = torch.maximum(-a * rho, -a * rho.clamp(1 - clip_low, 1 + clip_high))
    if a < 0:
        dual_clipped = loss > -a * dual_clip
        loss = torch.minimum(loss, torch.full_like(loss, -a * dual_clip))
    else:
        dual_clipped = torch.zeros_like(rho, dtype=torch.bool)
    clipped = (rho > 1 + clip_high) if a > 0 else (rho < 1 - clip_low)
    return ArmorTokens(loss, rho.detach(), clipped, dual_clipped)


def warmup_lr(lr: float, warmup_steps: int, rl_step: int) -> float:
    """Linear warmup over RL steps, then constant: RL step k (0-based) runs at lr * min(1, (k + 1) / warmup)."""
    return lr if warmup_steps == 0 else lr * min(1.0, (rl_step + 1) / warmup_steps)


class ReferenceOptimizer:
    """torch.optim.AdamW over HF-named float64 parameters, after torch.nn.utils.clip_grad_norm_.

    `decay` picks the parameters that get weight decay: armor.md §6 (verl's AdamW over
    `module.parameters()`) decays all of them; Megatron's convention exempts biases and other 1-D tensors.
    """

    def __init__(self, params: dict[str, torch.Tensor], *, weight_decay: float, betas: tuple[float, float],
                 eps: float, grad_clip: float | None, decay=lambda name, p: True) -> None:
        self.params = params
        self.grad_clip = grad_clip
        decayed = [p for n, p in params.items() if decay(n, p)]
        exempt = [p for n, p in params.items() if not decay(n, p)]
        groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=0.0, betas=betas, eps=eps)

    def step(self, grads: dict[str, torch.Tensor], lr: float) -> float:
        """One AdamW step at `lr` on `grads` (clipped to a global norm of grad_clip); the pre-clip norm."""
        for name, p in self.params.items():
            p.grad = grads[name].detach().to(p.dtype).clone()
        tensors = list(self.params.values())
        if self.grad_clip is None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in tensors]))
        else:
            norm = torch.nn.utils.clip_grad_norm_(tensors, self.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)
