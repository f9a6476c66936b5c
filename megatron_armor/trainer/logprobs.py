"""Per-token logprobs and entropy of (tensor-parallel) Megatron models via Megatron's schedules.

Logits stay vocab-sharded: each TP rank holds `[B, S, V/tp]` and the log-softmax normaliser is
assembled with all-reduces (Megatron's `vocab_parallel_cross_entropy`), so no rank ever
materialises full-vocabulary logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_armor.distributed.cpu_compat import megatron_device_scope
from megatron_armor.trainer.batch import SequenceBatch

# loss_fn(logits [b, S, V/tp], micro_batch) -> (summed loss (0-dim), token count (0-dim int), stats)
LossFn = Callable[[torch.Tensor, SequenceBatch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[labels] over the full vocabulary, differentiable.

    logits: [B, S, V/tp] this rank's vocab shard; labels: [B, S] int64 global ids -> [B, S] float32.
    """
    scaled = logits.float() / temperature  # a fresh tensor: Megatron's CE works on it in place
    return -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the full vocabulary. logits [B, S, V/tp] -> [B, S]."""
    group = parallel_state.get_tensor_model_parallel_group()
    scaled = logits.float() / temperature
    logits_max = scaled.amax(dim=-1)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - logits_max.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])  # one all-reduce for both
    dist.all_reduce(sums, group=group)
    sum_exp, sum_exp_shifted = sums
    return sum_exp.log() - sum_exp_shifted / sum_exp


def forward_backward(
    model: torch.nn.Module, micro_batches: Sequence[SequenceBatch], loss_fn: LossFn, *, forward_only: bool
) -> list[dict[str, torch.Tensor]]:
    """Run Megatron's schedule (no pipelining or 1F1B, per parallel_state) over `micro_batches`.

    Returns the stats dict of every micro-batch on the last pipeline stage (empty list elsewhere).
    Gradients (when not forward_only) accumulate into the model; with `calculate_per_token_loss`
    Megatron's `finalize_model_grads` divides them by the total token count.
    """
    batches = list(micro_batches)
    shapes = {tuple(mb.input_ids.shape) for mb in batches}
    if len(shapes) != 1 and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(f"pipeline parallelism needs equal micro-batch shapes, got {sorted(shapes)}")
    mb_size, seq_len = batches[0].input_ids.shape

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        output = chunk(mb.input_ids, mb.position_ids, None)
        return output, lambda logits: loss_fn(logits, mb)

    with megatron_device_scope():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=seq_len,
            micro_batch_size=mb_size,
            forward_only=forward_only,
        )


@dataclass
class LogprobResult:
    """logprobs: [B, S] float32 label-aligned; entropy: [B, S] float32 or None (both 0 off-response)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module, batch: SequenceBatch, *, micro_batch_size: int, temperature: float = 1.0,
    with_entropy: bool = False,
) -> LogprobResult:
    """Logprobs of `batch.labels` under `model` (forward only), identical on every rank."""

    def collect(logits: torch.Tensor, mb: SequenceBatch):
        stats = {"logprobs": token_logprobs(logits, mb.labels, temperature) * mb.response_mask}
        if with_entropy:
            stats["entropy"] = token_entropy(logits, temperature) * mb.response_mask
        return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), stats

    was_training = model.training
    model.eval()
    outputs = forward_backward(model, list(batch.micro_batches(micro_batch_size)), collect, forward_only=True)
    model.train(was_training)
    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    result = {}
    for key in keys:
        values = torch.cat([out[key] for out in outputs]) if outputs else torch.empty(batch.input_ids.shape)
        result[key] = _broadcast_from_last_stage(values)
    return LogprobResult(logprobs=result["logprobs"], entropy=result.get("entropy"))


def _broadcast_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """Share a tensor computed on the last pipeline stage with the other stages (no-op without PP)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    dist.broadcast(
        values,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return values
