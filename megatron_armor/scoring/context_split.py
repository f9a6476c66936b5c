"""A micro-batch's tokens split over the context-parallel group, and its token scores gathered back.

Each CP rank feeds the model its zig-zag chunks of every row (`distributed.context_parallel.ZigZag`): the rows
[b, s] are right-padded to a multiple of 2 x CP x TP (so that under sequence parallelism each rank's 2c tokens
split over the TP ranks too; the padding is causal-masked away from the real tokens), and rank r keeps columns of
chunks r and 2CP-1-r, their global position ids with them. The label scores the rank computes on its chunks
[b, 2c] are all-gathered into the whole rows [b, s] on every CP rank, so the loss and every statistic are the
unsplit run's, computed alike on each CP rank; the gather's backward keeps a rank's own chunks' gradient (every
rank's loss is the same function of the gathered scores), so the weight gradients, summed over the CP group by
Megatron's DDP (which reduces over data-parallel x CP ranks), are the unsplit run's. The loss's unit count, which
`finalize_model_grads` sums over the same ranks, is counted by CP rank 0 alone (`count_once`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from megatron_armor.distributed.context_parallel import ZigZag, gather_sequence


@dataclass(frozen=True)
class ContextSplit:
    """This rank's place in the CP group (`layout`) and the multiple its chunk pairs are padded to (the TP size)."""

    layout: ZigZag
    multiple: int = 1

    @classmethod
    def current(cls) -> ContextSplit | None:
        """The split `parallel_state` asks for; None without context parallelism (or without its groups)."""
        group = parallel_state.get_context_parallel_group(check_initialized=False)
        if group is None or group.size() == 1:
            return None
        return cls(ZigZag.current(group), parallel_state.get_tensor_model_parallel_world_size())

    def tokens(self, input_ids: torch.Tensor,
               labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's chunks [b, 2c] of the token ids, (global) position ids and labels of right-padded rows
        [b, s] (whose position ids are 0..s-1)."""
        padded = self.layout.padded_length(input_ids.shape[1], self.multiple)
        positions = torch.arange(padded, device=input_ids.device).expand(input_ids.shape[0], -1)
        return tuple(self.layout.split(tensor, 1) for tensor in (
            self._pad(input_ids, padded), positions, self._pad(labels, padded)))

    def gather(self, scores: torch.Tensor, width: int) -> torch.Tensor:
        """Per-token scores of this rank's chunks [b, 2c] as the whole rows [b, width] (differentiable)."""
        return gather_sequence(scores, 1, reduce_grad=False)[:, :width]

    def count_once(self, units: torch.Tensor) -> torch.Tensor:
        """`units` on CP rank 0, zero on the others (every CP rank computes the same loss and units)."""
        return units if self.layout.rank == 0 else torch.zeros_like(units)

    @staticmethod
    def _pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
        return F.pad(tensor, (0, length - tensor.shape[1]))
