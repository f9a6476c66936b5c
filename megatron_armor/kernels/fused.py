"""Fused LM head + log-softmax (+ entropy, + ARMOR loss) as autograd functions; never materialises [N, V].

The forward kernel yields per-token statistics of each vocab split of this rank's shard; they are merged
here (online-softmax rescaling), across the tensor-parallel group with one MAX and one SUM all-reduce of
[N] vectors. The backward recomputes logit tiles from the saved [N] vectors lse, entropy and the
per-token upstream gradient. `hidden` is replicated over `tp_group` (no sequence parallelism), so its
gradient is all-reduced, as ColumnParallelLinear does for its input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_armor.algorithms import armor_policy_loss
from megatron_armor.algorithms.reduce import masked_mean
from megatron_armor.kernels.reference import IGNORE_INDEX
from megatron_armor.kernels.tiles import default_tiles, interpreting
from megatron_armor.kernels.triton_logprobs import ShardStats, shard_grads, shard_stats

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class _Problem:
    """Validated inputs: hidden [N, H] and weight [V_local, H] row-contiguous; local_labels [N] int64 index into
    this shard (-1 when elsewhere or ignored); valid [N] bool (label != IGNORE_INDEX)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    local_labels: torch.Tensor
    valid: torch.Tensor
    temperature: float
    tp_group: dist.ProcessGroup | None
    filter_eps: float | None


def _problem(hidden, weight, labels, temperature, tp_group, filter_eps) -> _Problem:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V_local, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hidden and weight must share a dtype in {SUPPORTED_DTYPES}, got {hidden.dtype} and "
                        f"{weight.dtype}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.device.type == "cpu" and not interpreting():
        raise RuntimeError("fused kernels on CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before importing megatron_armor.kernels, or use megatron_armor.kernels.reference")
    v_local = weight.shape[0]
    vocab_start = dist.get_rank(tp_group) * v_local if tp_group is not None else 0
    local = labels.long() - vocab_start
    valid = labels != IGNORE_INDEX
    local = torch.where(valid & (local >= 0) & (local < v_local), local, -1)
    return _Problem(hidden.contiguous(), weight.contiguous(), local, valid, float(temperature), tp_group, filter_eps)


@dataclass(frozen=True)
class _TokenStats:
    """[N] float32 each: logprobs (0 on ignored labels; None once restored for the backward), entropy,
    lse = logsumexp_v z over the full vocabulary."""

    logprobs: torch.Tensor | None
    entropy: torch.Tensor
    lse: torch.Tensor


def _merge(stats: ShardStats, valid: torch.Tensor, tp_group: dist.ProcessGroup | None) -> _TokenStats:
    """Combine [splits, N] statistics over splits and TP ranks into full-vocabulary logprobs and entropy."""
    top = stats.max.amax(0)  # [N]
    if tp_group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    offset = stats.max - top  # [splits, N], <= 0
    scale = offset.exp()
    packed = torch.stack([
        (scale * stats.sumexp).sum(0),
        (scale * (stats.shifted + offset * stats.sumexp)).sum(0),
        stats.target.sum(0),  # the label lives in exactly one split of one rank
    ])  # [3, N]
    if tp_group is not None:
        dist.all_reduce(packed, group=tp_group)
    sumexp, shifted, target = packed
    log_sumexp = sumexp.log()  # >= 0: the split holding the max contributes e^0 = 1
    lse = top + log_sumexp
    logprobs = torch.where(valid, target - lse, 0.0)  # target <= top <= lse, so never positive
    return _TokenStats(logprobs=logprobs, entropy=log_sumexp - shifted / sumexp, lse=lse)


def _forward(p: _Problem) -> _TokenStats:
    tiles = default_tiles(p.hidden.shape[0], p.weight.shape[0], p.hidden.shape[1])
    return _merge(shard_stats(p.hidden, p.weight, p.local_labels, p.temperature, tiles), p.valid, p.tp_group)


def _backward(p: _Problem, stats: _TokenStats, grad_logp: torch.Tensor,
              grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) in the input dtype from [N] upstream gradients of logprobs and entropy."""
    grad_logp = torch.where(p.valid, grad_logp.float(), 0.0).contiguous()  # ignored labels: logprob is constant 0
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
    tiles = default_tiles(p.hidden.shape[0], p.weight.shape[0], p.hidden.shape[1])
    grad_hidden, grad_weight = shard_grads(p.hidden, p.weight, p.local_labels, stats.lse, grad_logp, grad_entropy,
                                           stats.entropy, p.temperature, tiles, p.filter_eps)
    if p.tp_group is not None:
        dist.all_reduce(grad_hidden, group=p.tp_group)
    return grad_hidden.to(p.hidden.dtype), grad_weight.to(p.weight.dtype)


def _save(ctx, p: _Problem, stats: _TokenStats, *extra: torch.Tensor) -> None:
    ctx.save_for_backward(p.hidden, p.weight, p.local_labels, p.valid, stats.lse, stats.entropy, *extra)
    ctx.settings = (p.temperature, p.tp_group, p.filter_eps)


def _restore(ctx) -> tuple[_Problem, _TokenStats, tuple[torch.Tensor, ...]]:
    hidden, weight, local_labels, valid, lse, entropy, *extra = ctx.saved_tensors
    problem = _Problem(hidden, weight, local_labels, valid, *ctx.settings)
    return problem, _TokenStats(logprobs=None, entropy=entropy, lse=lse), tuple(extra)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, filter_eps):
        ctx.set_materialize_grads(False)
        problem = _problem(hidden, weight, labels, temperature, tp_group, filter_eps)
        stats = _forward(problem)
        _save(ctx, problem, stats)
        return stats.logprobs, stats.entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        problem, stats, _ = _restore(ctx)
        if grad_logp is None:
            grad_logp = torch.zeros_like(stats.lse)
        grad_hidden, grad_weight = _backward(problem, stats, grad_logp, grad_entropy)
        return grad_hidden, grad_weight, None, None, None, None


class _FusedArmorLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, old_logp, ref_logp, advantages, mask, temperature, tp_group,
                filter_eps, loss_kwargs, stats_out):
        problem = _problem(hidden, weight, labels, temperature, tp_group, filter_eps)
        stats = _forward(problem)
        # The loss and d loss / d logp on [N] vectors: autograd of armor_policy_loss itself, so clipping
        # and tie-breaking are exactly the reference's.
        with torch.enable_grad():
            logp = stats.logprobs.detach().requires_grad_()
            loss, loss_stats = armor_policy_loss(logp, old_logp, ref_logp, advantages, mask, **loss_kwargs)
            (grad_logp,) = torch.autograd.grad(loss, logp)
        stats_out.update(loss_stats, entropy=masked_mean(stats.entropy, mask))
        _save(ctx, problem, stats, grad_logp)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss):
        problem, stats, (grad_logp,) = _restore(ctx)
        grad_hidden, grad_weight = _backward(problem, stats, grad_loss * grad_logp, None)
        return grad_hidden, grad_weight, *([None] * 10)


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   tp_group: dist.ProcessGroup | None = None,
                   filter_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of softmax(hidden @ weight_full.T / temperature), both [N] float32, differentiable.

    hidden [N, H] (replicated over tp_group); weight [V_local, H] this rank's contiguous vocab shard (rank r holds
    rows r*V_local ...), same dtype, fp32 or bf16; labels [N] global ids, IGNORE_INDEX (-100) -> logprob 0.
    Gradients flow to hidden and weight from both outputs. filter_eps (e.g. 2**-12, Cut Cross-Entropy's
    choice for bf16) skips backward tiles whose every gradient entry is below filter_eps x the token's
    upstream gradient; None computes every tile.
    """
    return _FusedLogprobs.apply(hidden, weight, labels, temperature, tp_group, filter_eps)


def fused_armor_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, old_logp: torch.Tensor,
                     ref_logp: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *, alpha: float,
                     clip_low: float, clip_high: float, dual_clip: float, temperature: float = 1.0,
                     token_normalizer: float | None = None, tp_group: dist.ProcessGroup | None = None,
                     filter_eps: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`armor_policy_loss` of the fused logprobs in one pass: (loss 0-dim, stats), gradients to hidden and weight.

    old_logp, ref_logp, advantages, mask: [N] (advantages per token); other arguments as `fused_logprobs` and
    `armor_policy_loss`. stats: armor_policy_loss's statistics plus `entropy` (masked mean), all detached.
    Only [N] vectors are kept between forward and backward.
    """
    stats: dict[str, torch.Tensor] = {}
    loss_kwargs = dict(alpha=alpha, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                       token_normalizer=token_normalizer)
    detach = lambda t: None if t is None else t.detach()  # noqa: E731
    loss = _FusedArmorLoss.apply(hidden, weight, labels, detach(old_logp), detach(ref_logp), detach(advantages),
                                 detach(mask), temperature, tp_group, filter_eps, loss_kwargs, stats)
    return loss, stats
