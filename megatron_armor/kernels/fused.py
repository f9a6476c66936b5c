"""Fused LM head + log-softmax (+ entropy, + ARMOR loss) as autograd functions; never materialises [N, V].

The forward kernel yields per-token statistics of each vocab split of this rank's shard; they are merged
here (online-softmax rescaling), across the tensor-parallel group with one MAX and one SUM all-reduce of
[N] vectors. The backward recomputes logit tiles from the saved [N] vectors lse, entropy and the
per-token upstream gradient. `hidden` is replicated over `tp_group` (no sequence parallelism), so its
gradient is all-reduced, as ColumnParallelLinear does for its input.

Padded vocabularies: Megatron pads the output weight to a multiple of the TP size (here of 128); rows at
global index >= `vocab_size` are padding. The kernels never read them: they score only this shard's
valid rows, so padding takes no part in max / sum-exp / entropy and gets zero gradient.

Megatron DDP: when the weight carries DDP's fp32 `main_grad` buffer, the backward accumulates the weight
gradient straight into it (as Megatron's linear layers do with gradient_accumulation_fusion) instead of
returning a separate [V_local, H] gradient; see `_autograd_weight_grad`.
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
    """Validated inputs: hidden [N, H] and weight [V_local, H] row-contiguous, of which the first `valid_rows`
    rows are vocabulary (the rest padding); local_labels [N] int64 index into this shard (-1 when elsewhere or
    ignored); valid [N] bool (label != IGNORE_INDEX); main_grad: the weight's fp32 [V_local, H] Megatron DDP
    gradient buffer the backward accumulates into, or None to return the weight gradient to autograd."""

    hidden: torch.Tensor
    weight: torch.Tensor
    local_labels: torch.Tensor
    valid: torch.Tensor
    valid_rows: int
    temperature: float
    tp_group: dist.ProcessGroup | None
    filter_eps: float | None
    main_grad: torch.Tensor | None

    @property
    def settings(self) -> tuple:
        """The non-tensor fields, in order, as kept on the autograd context."""
        return self.valid_rows, self.temperature, self.tp_group, self.filter_eps, self.main_grad


def _problem(hidden, weight, labels, temperature, tp_group, filter_eps, vocab_size) -> _Problem:
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
    rank, world = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group is not None else (0, 1)
    if vocab_size is None:
        vocab_size = v_local * world
    if not 0 < vocab_size <= v_local * world:
        raise ValueError(f"vocab_size must be in [1, {v_local * world}] (the weight's {v_local} rows x {world} "
                         f"tensor-parallel shards), got {vocab_size}")
    vocab_start = rank * v_local
    local = labels.long() - vocab_start
    valid = labels != IGNORE_INDEX
    local = torch.where(valid & (local >= 0) & (local < v_local), local, -1)
    valid_rows = min(max(vocab_size - vocab_start, 0), v_local)
    return _Problem(hidden.contiguous(), weight.contiguous(), local, valid, valid_rows, float(temperature), tp_group,
                    filter_eps, _accumulable_main_grad(weight))


def _accumulable_main_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """Megatron DDP's gradient buffer view `weight.main_grad` when the backward kernel can add into it: fp32,
    contiguous, the weight's shape. None otherwise (no DDP, or a 16-bit buffer: the gradient then goes back
    through autograd and DDP's hook adds it)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or not weight.requires_grad or not weight.is_contiguous():
        return None
    if main_grad.dtype != torch.float32 or main_grad.shape != weight.shape or not main_grad.is_contiguous():
        return None
    return main_grad


def _autograd_weight_grad(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor | None:
    """What autograd receives for `weight` once its gradient is already in `main_grad`.

    Megatron's contract (LinearWithGradAccumulationAndAsyncCommunication with gradient_accumulation_fusion):
    a DDP-managed weight (it has `grad_added_to_main_grad`) is flagged and gets a dummy gradient, so that
    DDP's post-accumulation hook still runs; the hook adds `.grad` to `main_grad` only when
    `zero_out_wgrad` is set -- a weight tied to the embedding on this pipeline stage, whose lookup
    gradient joins the dummy -- so the dummy is zeros there and left uninitialised otherwise.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    dummy = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return dummy(main_grad.shape, dtype=weight.dtype, device=weight.device)


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
    offset = stats.max - top  # [splits, N], <= 0; -inf for a shard without vocabulary rows
    scale = offset.exp()
    rebase = torch.where(stats.sumexp > 0, offset * stats.sumexp, 0.0)  # 0, not -inf * 0, for such a shard
    packed = torch.stack([
        (scale * stats.sumexp).sum(0),
        (scale * (stats.shifted + rebase)).sum(0),
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
    tiles = default_tiles(p.hidden.shape[0], p.valid_rows, p.hidden.shape[1])
    stats = shard_stats(p.hidden, p.weight, p.valid_rows, p.local_labels, p.temperature, tiles)
    return _merge(stats, p.valid, p.tp_group)


def _backward(p: _Problem, stats: _TokenStats, grad_logp: torch.Tensor,
              grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_hidden, grad_weight for autograd) in the input dtype from [N] upstream gradients of logprobs and
    entropy. With `p.main_grad` the weight gradient is added into it and grad_weight is Megatron's dummy."""
    grad_logp = torch.where(p.valid, grad_logp.float(), 0.0).contiguous()  # ignored labels: logprob is constant 0
    if grad_entropy is not None:
        grad_entropy = grad_entropy.float().contiguous()
    tiles = default_tiles(p.hidden.shape[0], p.valid_rows, p.hidden.shape[1])
    grad_hidden, grad_weight = shard_grads(p.hidden, p.weight, p.valid_rows, p.local_labels, stats.lse, grad_logp,
                                           grad_entropy, stats.entropy, p.temperature, tiles, p.filter_eps,
                                           weight_grad_out=p.main_grad)
    if p.tp_group is not None:
        dist.all_reduce(grad_hidden, group=p.tp_group)
    if p.main_grad is not None:
        return grad_hidden.to(p.hidden.dtype), _autograd_weight_grad(p.weight, p.main_grad)
    return grad_hidden.to(p.hidden.dtype), grad_weight.to(p.weight.dtype)


def _save(ctx, p: _Problem, stats: _TokenStats, *extra: torch.Tensor) -> None:
    ctx.save_for_backward(p.hidden, p.weight, p.local_labels, p.valid, stats.lse, stats.entropy, *extra)
    # main_grad stays off save_for_backward (as in Megatron's linear layers): DDP and other layers modify
    # the buffer in place between this forward and the backward.
    ctx.settings = p.settings


def _restore(ctx) -> tuple[_Problem, _TokenStats, tuple[torch.Tensor, ...]]:
    hidden, weight, local_labels, valid, lse, entropy, *extra = ctx.saved_tensors
    problem = _Problem(hidden, weight, local_labels, valid, *ctx.settings)
    return problem, _TokenStats(logprobs=None, entropy=entropy, lse=lse), tuple(extra)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, tp_group, filter_eps, vocab_size):
        ctx.set_materialize_grads(False)
        problem = _problem(hidden, weight, labels, temperature, tp_group, filter_eps, vocab_size)
        stats = _forward(problem)
        _save(ctx, problem, stats)
        return stats.logprobs, stats.entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        problem, stats, _ = _restore(ctx)
        if grad_logp is None:
            grad_logp = torch.zeros_like(stats.lse)
        grad_hidden, grad_weight = _backward(problem, stats, grad_logp, grad_entropy)
        return grad_hidden, grad_weight, None, None, None, None, None


class _FusedArmorLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, old_logp, ref_logp, advantages, mask, temperature, tp_group,
                filter_eps, vocab_size, loss_kwargs, stats_out):
        problem = _problem(hidden, weight, labels, temperature, tp_group, filter_eps, vocab_size)
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
        return grad_hidden, grad_weight, *([None] * 11)


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   vocab_size: int | None = None, tp_group: dist.ProcessGroup | None = None,
                   filter_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of softmax(hidden @ weight_full[:vocab_size].T / temperature), both [N] float32,
    differentiable.

    hidden [N, H] (replicated over tp_group); weight [V_local, H] this rank's contiguous vocab shard (rank r holds
    rows r*V_local ...), same dtype, fp32 or bf16; labels [N] global ids in [0, vocab_size), IGNORE_INDEX (-100)
    -> logprob 0. vocab_size: the real vocabulary; rows at global index >= vocab_size are padding, excluded
    from the softmax and given zero gradient (None: every row is real). Gradients flow to hidden and weight
    from both outputs; a weight with Megatron DDP's fp32 `main_grad` gets its gradient added there directly
    (`grad_added_to_main_grad` set, a dummy returned to autograd). filter_eps (e.g. 2**-12, Cut
    Cross-Entropy's choice for bf16) skips backward tiles whose every gradient entry is below filter_eps x
    the token's upstream gradient; None computes every tile.
    """
    return _FusedLogprobs.apply(hidden, weight, labels, temperature, tp_group, filter_eps, vocab_size)


def fused_armor_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, old_logp: torch.Tensor,
                     ref_logp: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
                     temperature: float = 1.0, vocab_size: int | None = None,
                     tp_group: dist.ProcessGroup | None = None, filter_eps: float | None = None,
                     **loss_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`armor_policy_loss` of the fused logprobs in one pass: (loss 0-dim, stats), gradients to hidden and weight.

    old_logp, ref_logp, advantages, mask: [N] (advantages per token); loss_kwargs: armor_policy_loss's keyword
    arguments (alpha, clip_low, ...); the others as `fused_logprobs`. stats: armor_policy_loss's statistics
    plus `entropy` (masked mean), all detached. Only [N] vectors are kept between forward and backward.
    """
    stats: dict[str, torch.Tensor] = {}
    detach = lambda t: None if t is None else t.detach()  # noqa: E731
    loss = _FusedArmorLoss.apply(hidden, weight, labels, detach(old_logp), detach(ref_logp), detach(advantages),
                                 detach(mask), temperature, tp_group, filter_eps, vocab_size, loss_kwargs, stats)
    return loss, stats
