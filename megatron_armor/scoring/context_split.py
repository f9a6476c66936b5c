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

A packed micro-batch (THD) is split sequence by sequence: each sequence of the pack is right-padded to a multiple
of 2 x CP x TP, the rank keeps its zig-zag chunks of every sequence (Megatron's THD layout under CP: the
cu_seqlens Megatron gets are the re-padded row's, global; its rotary embedding picks each sequence's chunk
positions from them), and the gathered scores are put back into the pack's own layout, which `MicroBatch.unpack`
reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_armor.distributed.context_parallel import ZigZag, gather_sequence


@dataclass(frozen=True)
class TokenSplit:
    """How per-token values move between a micro-batch's model tokens and a CP rank's share of them: the model tokens
    have `width` per row (rows [b, width], or the packed row [1, width]), right-padded to `length` (packed: each
    sequence padded on its own, `cu_seqlens` the padded row's offsets and `index` [width] where each model token
    sits in it) and split zig-zag by `layout` (packed: sequence by sequence)."""

    layout: ZigZag
    width: int
    length: int
    cu_seqlens: tuple[int, ...] | None = None
    index: torch.Tensor | None = None

    def split(self, values: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """Per-token `values` [b, width, ...] as this rank's share [b, length / CP, ...]; the padding holds `fill`."""
        whole = values.new_full((values.shape[0], self.length, *values.shape[2:]), fill)
        whole[:, slice(self.width) if self.index is None else self.index] = values
        return self.layout.split(whole, 1, self.cu_seqlens)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token `values` of this rank's share [b, length / CP, ...] as the model tokens had them
        [b, width, ...], from every CP rank; differentiable."""
        whole = gather_sequence(values, 1, reduce_grad=False, cu_seqlens=self.cu_seqlens)
        return whole[:, slice(self.width) if self.index is None else self.index]


@dataclass(frozen=True)
class RankShare:
    """What a CP rank feeds the model of one micro-batch: its chunks of the token ids, (global) position ids and
    labels ([b, 2c] rows, or packed [1, T_p / CP]), and packed, Megatron's THD description of them (`packing`: the
    re-padded row's global cu_seqlens); `tokens`: how per-token values move between the micro-batch's model tokens
    and this share."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    packing: PackedSeqParams | None
    tokens: TokenSplit


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

    def share(self, input_ids: torch.Tensor, labels: torch.Tensor,
              packing: PackedSeqParams | None = None) -> RankShare:
        """This rank's share of a micro-batch's model tokens: right-padded rows [b, s] (whose position ids are
        0..s-1), or a packed row [1, T] with its `packing`."""
        if packing is not None:
            return self._packed_share(input_ids, labels, packing)
        width = input_ids.shape[1]
        tokens = TokenSplit(self.layout, width, self.layout.padded_length(width, self.multiple))
        positions = torch.arange(tokens.length, device=input_ids.device).expand(input_ids.shape[0], -1)
        return RankShare(tokens.split(input_ids), self.layout.split(positions, 1), tokens.split(labels), None, tokens)

    def count_once(self, units: torch.Tensor) -> torch.Tensor:
        """`units` on CP rank 0, zero on the others (every CP rank computes the same loss and units)."""
        return units if self.layout.rank == 0 else torch.zeros_like(units)

    def _packed_share(self, input_ids: torch.Tensor, labels: torch.Tensor, packing: PackedSeqParams) -> RankShare:
        """Every sequence of the pack (a segment of `packing.cu_seqlens_q`) right-padded to a multiple of
        2 x CP x TP, then split zig-zag sequence by sequence (`ZigZag.packed_positions`)."""
        bounds, device = packing.cu_seqlens_q.tolist(), input_ids.device
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        padded = [self.layout.padded_length(n, self.multiple) for n in lengths]
        cu_seqlens = (0, *itertools.accumulate(padded))
        index = torch.cat([start + torch.arange(n, device=device) for start, n in zip(cu_seqlens, lengths)])
        tokens = TokenSplit(self.layout, input_ids.shape[1], cu_seqlens[-1], cu_seqlens, index)
        positions = torch.cat([self.layout.positions(n, device=device) for n in padded])[None]
        offsets = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                                 max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
        return RankShare(tokens.split(input_ids), positions, tokens.split(labels), params, tokens)
