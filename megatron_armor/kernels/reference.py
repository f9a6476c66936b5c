"""Plain-torch LM-head logprobs / entropy / ARMOR loss: the reference the fused kernels are tested against.

`reference_logprobs` materialises the full [N, V] float32 logits (eager); `chunked_logprobs` holds one
[chunk, V] block at a time and recomputes it in the backward (activation checkpointing). Both take the
full, unsharded weight.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatron_armor.algorithms import armor_policy_loss

IGNORE_INDEX = -100


def reference_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of softmax(hidden @ weight.T / T), differentiable.

    hidden [N, H], weight [V, H] (any float dtype, computed in float32 or float64 if given);
    labels [N] int64, IGNORE_INDEX -> logprob 0. Returns two [N] tensors in the compute dtype.
    """
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden.to(dtype) @ weight.to(dtype).T / temperature  # [N, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    ignored = labels == IGNORE_INDEX
    picked = log_probs.gather(1, labels.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked.masked_fill(ignored, 0.0), entropy


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_logprobs` over token chunks of `chunk_size`; peak extra memory ~ a few [chunk, V] float32."""
    parts = [
        checkpoint(reference_logprobs, hidden[i : i + chunk_size], weight, labels[i : i + chunk_size], temperature,
                   use_reentrant=False)
        for i in range(0, hidden.shape[0], chunk_size)
    ]
    logprobs, entropy = zip(*parts)
    return torch.cat(logprobs), torch.cat(entropy)


def reference_armor_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, old_logp: torch.Tensor,
                         ref_logp: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
                         temperature: float = 1.0, **loss_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """armor_policy_loss on `reference_logprobs`; [N] token vectors, loss_kwargs as armor_policy_loss."""
    logp, _ = reference_logprobs(hidden, weight, labels, temperature)
    return armor_policy_loss(logp, old_logp, ref_logp, advantages, mask, **loss_kwargs)
