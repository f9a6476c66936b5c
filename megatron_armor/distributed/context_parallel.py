"""Context parallelism (CP): each sequence split over the CP group in load-balanced zig-zag chunks.

A sequence of S tokens (padded to a multiple of 2 x CP, `ZigZag.padded_length`) is cut into 2 x CP chunks of
c = S / (2 CP) tokens; CP rank r keeps chunks r and 2CP-1-r, i.e. 2c tokens (Megatron-LM's
`get_batch_on_this_cp_rank` layout, which Megatron's rotary embedding assumes: `get_pos_emb_on_this_cp_rank`).
Under a causal mask an early chunk attends to few keys and a late one to many: pairing chunk r with its mirror
gives every rank the same attention work. A packed row (THD) is split sequence by sequence: each sequence, padded
to a multiple of 2 x CP, is cut into its own 2 x CP chunks, and a rank holds its chunks of every sequence.

`gather_sequence` all-gathers the ranks' local pieces back into the whole sequence, differentiably, with one of
two backward rules: each rank's gradient of the whole is
- "own" (`reduce_grad=False`): complete, because every rank computes the same function of the gathered tensor
  (token scores gathered before the loss): a rank keeps its own chunks' gradient;
- "partial" (`reduce_grad=True`): only the share of this rank's consumers (keys and values gathered inside
  attention, used by this rank's queries alone): the gradients are summed over the group first (an all-reduce;
  gloo has no reduce-scatter), then a rank keeps its own chunks'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state


@dataclass(frozen=True)
class ZigZag:
    """The zig-zag layout of a sequence dimension over a CP group of `size` ranks, seen from rank `rank`."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"CP rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def current(cls, group: dist.ProcessGroup | None = None) -> ZigZag:
        """This process's layout in `group` (default: `parallel_state`'s context-parallel group)."""
        group = group or parallel_state.get_context_parallel_group()
        return cls(dist.get_world_size(group), dist.get_rank(group))

    def padded_length(self, seq_len: int, multiple: int = 1) -> int:
        """The smallest length >= `seq_len` that splits into 2 x size chunks whose pairs are multiples of
        `multiple` (sequence parallelism splits each rank's 2c tokens over the TP ranks: pass the TP size)."""
        step = 2 * self.size * multiple
        return -(-seq_len // step) * step

    def positions(self, seq_len: int, rank: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """[2c] int64 global positions of `rank`'s (default: this rank's) tokens of a `seq_len`-token sequence."""
        rank = self.rank if rank is None else rank
        chunk = self._chunk(seq_len)
        offsets = torch.arange(chunk, device=device)
        return torch.cat([rank * chunk + offsets, (2 * self.size - 1 - rank) * chunk + offsets])

    def causal_mask(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """[2c, S] bool, True where this rank's query (row) must not see a key of the whole sequence (column): the
        key's global position is past the query's (Megatron's convention: True = masked out)."""
        return torch.arange(seq_len, device=device)[None, :] > self.positions(seq_len, device=device)[:, None]

    def packed_positions(self, cu_seqlens: Sequence[int], rank: int | None = None,
                         device: torch.device | None = None) -> torch.Tensor:
        """[T / size] int64 positions in a packed row (THD) of `rank`'s tokens: its zig-zag chunks of every
        sequence, sequence after sequence; `cu_seqlens` [k + 1]: the sequences' offsets, each a multiple of 2 x size
        long (Megatron's THD layout under CP: each rank holds every sequence's chunks, cu_seqlens stay global)."""
        return torch.cat([start + self.positions(end - start, rank, device)
                          for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])])

    def split(self, tensor: torch.Tensor, dim: int, cu_seqlens: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's tokens of `tensor` along `dim`: its 2c tokens of the whole sequence (a multiple of 2 x size
        long), or of each packed sequence (`cu_seqlens`, see `packed_positions`)."""
        return tensor.index_select(dim, self._order(tensor.shape[dim], cu_seqlens, self.rank, tensor.device))

    def restore(self, pieces: torch.Tensor, dim: int, cu_seqlens: Sequence[int] | None = None) -> torch.Tensor:
        """The whole sequence (or packed row) from every rank's `split` concatenated in rank order along `dim`
        (the inverse)."""
        length = pieces.shape[dim]
        gathered_order = torch.cat([self._order(length, cu_seqlens, r, pieces.device) for r in range(self.size)])
        return pieces.index_select(dim, gathered_order.argsort())

    def _order(self, length: int, cu_seqlens: Sequence[int] | None, rank: int,
               device: torch.device | None) -> torch.Tensor:
        if cu_seqlens is None:
            return self.positions(length, rank, device)
        return self.packed_positions(cu_seqlens, rank, device)

    def _chunk(self, seq_len: int) -> int:
        if seq_len % (2 * self.size):
            raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {self.size} zig-zag chunks; "
                             f"pad it to {self.padded_length(seq_len)} (ZigZag.padded_length)")
        return seq_len // (2 * self.size)


def gather_sequence(local: torch.Tensor, dim: int, *, reduce_grad: bool, group: dist.ProcessGroup | None = None,
                    cu_seqlens: Sequence[int] | None = None) -> torch.Tensor:
    """Every CP rank's `local` piece [..., 2c, ...] (along `dim`) as the whole sequence [..., S, ...] in global
    order, or with `cu_seqlens` (global offsets of packed sequences) the whole packed row; on every rank;
    differentiable, with the backward rule `reduce_grad` picks (module docstring). Identity on a group of one."""
    group = group or parallel_state.get_context_parallel_group()
    if dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, dim, reduce_grad, group, None if cu_seqlens is None else tuple(cu_seqlens))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, reduce_grad: bool, group: dist.ProcessGroup,
                cu_seqlens: tuple[int, ...] | None) -> torch.Tensor:
        ctx.dim, ctx.reduce_grad, ctx.group, ctx.cu_seqlens = dim, reduce_grad, group, cu_seqlens
        layout = ZigZag.current(group)
        pieces = [torch.empty_like(local) for _ in range(layout.size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return layout.restore(torch.cat(pieces, dim), dim, cu_seqlens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_grad:
            grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: never the caller's buffer
            dist.all_reduce(grad, group=ctx.group)
        return ZigZag.current(ctx.group).split(grad, ctx.dim, ctx.cu_seqlens), None, None, None, None
