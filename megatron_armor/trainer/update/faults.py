"""Non-finite updates: find a mini-batch whose loss or gradients are not finite before its optimizer step,
name the ranks that saw it, and the error that stops a run after too many skipped steps in a row.

Gradients count as not finite also when they are finite but their norm is not in fp32 (the square of this rank's
gradient norm exceeds fp32's largest value): Megatron computes the clipping norm in fp32 and would clip by an
infinite norm, i.e. step with zeroed gradients.

Every rank takes the same decision: each rank's flags (loss, gradients) are all-gathered over the whole
job, so a NaN on one pipeline stage or data-parallel shard skips the step everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_armor.distributed.device import training_device


@dataclass(frozen=True)
class NonFiniteUpdate:
    """RL step `rl_step`'s mini-batch `mini_batch` (both 0-based; `describe` names the step as metrics.jsonl
    does, 1-based) had a non-finite loss on `loss_ranks` (global
    ranks; the loss exists on the last pipeline stage only) or non-finite gradients on `grad_ranks`."""

    rl_step: int
    mini_batch: int
    loss_ranks: tuple[int, ...]
    grad_ranks: tuple[int, ...]

    def describe(self) -> str:
        seen = [f"{what} on rank(s) {list(ranks)}" for what, ranks in
                (("non-finite loss", self.loss_ranks), ("non-finite gradients (or gradient norm)", self.grad_ranks)) if ranks]
        return f"RL step {self.rl_step + 1}, mini-batch {self.mini_batch}: {', '.join(seen)}"


def find_nonfinite(
    ddp: torch.nn.Module, outputs: list[dict[str, torch.Tensor]], *, rl_step: int, mini_batch: int,
) -> NonFiniteUpdate | None:
    """Collective over all ranks, after a mini-batch's forward-backward and before its optimizer step: None
    when every rank's loss partial sums (`outputs`, the loss callback's "loss/policy_loss" per micro-batch;
    empty off the last pipeline stage) and reduced gradients (DDP's grad buffers) are finite."""
    loss_ok = all(math.isfinite(float(out["loss/policy_loss"])) for out in outputs)
    flags = torch.tensor([not loss_ok, not _grads_finite(ddp)], dtype=torch.int32, device=training_device())  # [2]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [torch.empty_like(flags) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flags)
    else:
        gathered = [flags]
    by_rank = torch.stack(gathered).tolist()  # [world size][2]
    loss_ranks = tuple(rank for rank, (bad_loss, _) in enumerate(by_rank) if bad_loss)
    grad_ranks = tuple(rank for rank, (_, bad_grads) in enumerate(by_rank) if bad_grads)
    if not loss_ranks and not grad_ranks:
        return None
    return NonFiniteUpdate(rl_step, mini_batch, loss_ranks, grad_ranks)


FP32_MAX = torch.finfo(torch.float32).max


def _grads_finite(ddp: torch.nn.Module) -> bool:
    """Whether DDP's grad buffers hold only finite values whose squared norm is finite in fp32.

    Their min and max first (NaN propagates into both; no buffer-sized temporary, one device sync); only when
    max|g|^2 * numel could reach fp32's largest value is the squared norm summed, over g / max|g| (each term
    <= 1, so the sum cannot overflow) and scaled back in float64.
    """
    buffers = [buffer.grad_data for buffer in (*ddp.buffers, *ddp.expert_parallel_buffers)]
    if not buffers:
        return True
    extremes = torch.stack([value for grads in buffers for value in torch.aminmax(grads)])  # [2 * buffers]
    if not bool(torch.isfinite(extremes).all()):
        return False
    largest = float(extremes.abs().max())
    numel = sum(grads.numel() for grads in buffers)
    if largest == 0 or largest * largest * numel < FP32_MAX:
        return True
    scaled_squares = sum(float(torch.square(grads / largest).sum(dtype=torch.float64)) for grads in buffers)
    return largest * largest * scaled_squares < FP32_MAX


class TooManySkipsError(RuntimeError):
    """train.max_consecutive_skips RL steps in a row skipped their update (non-finite loss or gradients)."""

    def __init__(self, last_step: int, count: int, limit: int, checkpoint: Path) -> None:
        """`last_step`: the last skipped step, 1-based (as metrics.jsonl); `count` skips in a row up to it."""
        super().__init__(
            f"RL steps {last_step - count + 1}..{last_step} ({count} in a row) skipped their update: non-finite "
            f"loss or gradients (the warnings above name the mini-batch and the ranks); stopped at "
            f"train.max_consecutive_skips={limit}. The last good state is checkpointed at {checkpoint}: find the "
            f"cause (e.g. lower optimizer.lr, check the rewards and the data), then continue with --resume"
        )
