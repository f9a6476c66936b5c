"""Reductions of scalar metrics over Megatron's parallel groups.

Loss statistics exist only on the last pipeline stage and only for a rank's data-parallel shard;
these helpers turn them into job-wide values that every rank (in particular rank 0, which logs)
holds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_armor.distributed.device import collective_device, training_device


def sum_over_data_parallel(values: dict[str, float]) -> dict[str, float]:
    """Sum each value over the data-parallel group (every DP rank must pass the same keys)."""
    if parallel_state.get_data_parallel_world_size() == 1 or not values:
        return values
    keys = sorted(values)
    packed = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=training_device())  # NCCL: on the GPU
    dist.all_reduce(packed, group=parallel_state.get_data_parallel_group())
    return dict(zip(keys, packed.tolist()))


def sum_over_ranks(counts: list[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """Each count summed over every rank of `group` (default: the job's default group; every rank passes as many
    counts)."""
    return _all_reduce_ints(counts, dist.ReduceOp.SUM, group)


def max_over_ranks(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest of every rank's `value` over `group` (default: the job's default group)."""
    return _all_reduce_ints([value], dist.ReduceOp.MAX, group)[0]


def _all_reduce_ints(values: list[int], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[int]:
    """`values` reduced elementwise with `op` over `group` (unchanged without torch.distributed or with one rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    packed = torch.tensor(values, dtype=torch.int64, device=collective_device(group))  # NCCL: on the GPU
    dist.all_reduce(packed, op=op, group=group)
    return packed.tolist()


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank of the job (collective over the default group)."""
    return sum_over_ranks([int(flag)])[0] > 0


def mean_over_data_parallel(values: dict[str, float]) -> dict[str, float]:
    """Unweighted mean of each value over the data-parallel group."""
    size = parallel_state.get_data_parallel_world_size()
    return {k: v / size for k, v in sum_over_data_parallel(values).items()}


def from_last_pipeline_stage(values: dict[str, float]) -> dict[str, float]:
    """The last pipeline stage's `values` on every stage (other stages pass anything, e.g. {})."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    box = [values]
    dist.broadcast_object_list(
        box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]
