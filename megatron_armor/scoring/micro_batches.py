"""Cut a rank's batch into forward/backward micro-batches: fixed sizes or token budgets, padded or packed.

A `SequenceBatch` holds right-padded rows [B, S]. `MicroBatching.split` cuts it into `MicroBatch`es as the
micro_batching section says:
- fixed size: `micro_batch_size` consecutive rows each;
- token budget (`max_tokens`, verl's dynamic batch size): rows binned first-fit decreasing so that each
  micro-batch computes at most `max_tokens` tokens (its rows times its longest row, or packed, the sum of
  its rows); a row longer than the budget gets a micro-batch of its own.
Each micro-batch's rows are trimmed to its own longest row (rounded up to `pad_to_multiple_of`). Packed
(`pack`), its rows are concatenated into one row [1, T] with `cu_seqlens` (Megatron's `PackedSeqParams`, THD
format), so that only the tail rounding T up is padding; attention stays inside each sequence.

The loss always sees `MicroBatch.rows`, right-padded [n, s]: token scores of a packed micro-batch are
scattered back into that shape (`MicroBatch.unpack`), so every loss and statistic is unchanged by the
layout, and the loss stays the exact token mean of the mini-batch whatever the binning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_armor.config import MicroBatchingConfig
from megatron_armor.config.builders import builds
from megatron_armor.scoring.batch import SequenceBatch


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def sequence_multiple(tensor_parallel_size: int) -> int:
    """What a micro-batch's sequence length is padded to a multiple of: 8, and the tensor-parallel size (sequence
    parallelism splits the sequence over its ranks)."""
    return math.lcm(8, tensor_parallel_size)


@builds(MicroBatchingConfig)
@dataclass(frozen=True)
class MicroBatching:
    """How a batch is cut into micro-batches (see the module docstring).

    settings: the micro_batching section: micro_batch_size (rows per micro-batch without a token budget), max_tokens
      (token budget of a micro-batch, prompt + response tokens, padding included, or None) and pack (concatenate each
      micro-batch's rows into one packed row);
    pad_to_multiple_of: a micro-batch's sequence length (packed: its total length) is a multiple of this
      (`sequence_multiple` of the run's tensor-parallel size).
    """

    settings: MicroBatchingConfig = MicroBatchingConfig()
    pad_to_multiple_of: int = 8

    def __post_init__(self) -> None:
        if self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")

    def computed_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens the model computes for one micro-batch of rows of these real `lengths`, padding included."""
        if self.settings.pack:
            return round_up(sum(lengths), self.pad_to_multiple_of)
        return len(lengths) * round_up(max(lengths), self.pad_to_multiple_of)

    def bins(self, lengths: Sequence[int]) -> list[list[int]]:
        """Row indices of each micro-batch for rows of real token `lengths` (each bin ascending)."""
        size, max_tokens = self.settings.micro_batch_size, self.settings.max_tokens
        if max_tokens is None:
            return [list(range(start, min(start + size, len(lengths)))) for start in range(0, len(lengths), size)]
        bins: list[list[int]] = []
        for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):  # first fit, longest first
            fitting = (b for b in bins if self.computed_tokens([lengths[r] for r in (*b, row)]) <= max_tokens)
            target = next(fitting, None)
            if target is None:
                bins.append([row])
            else:
                target.append(row)
        return [sorted(b) for b in bins]

    def split(self, batch: SequenceBatch) -> list[MicroBatch]:
        """`batch` as micro-batches (their rows cover every row of `batch` once)."""
        lengths = batch.real_lengths().tolist()
        micro_batches = []
        for rows in self.bins(lengths):
            index = torch.tensor(rows, dtype=torch.long)
            width = round_up(max(lengths[r] for r in rows), self.pad_to_multiple_of)
            selected = batch.select(index).trim(width)
            packed = pack_rows(selected, self.pad_to_multiple_of) if self.settings.pack else None
            micro_batches.append(MicroBatch(selected, index, packed))
        return micro_batches


@dataclass
class PackedSequences:
    """A micro-batch's rows concatenated into one row of T tokens (T real tokens rounded up).

    input_ids, labels, position_ids: [1, T] int64 (positions restart at 0 in every sequence; labels are the
      rows' own, so the last token of a sequence never predicts the next sequence's first);
    cu_seqlens: [k + 1] int32 offsets of the k segments: every row's real tokens, then the padding tail (if
      any) as a segment of its own;
    max_seqlen: the longest segment;
    token_rows, token_columns: [T_real] int64, where packed token j sits in the right-padded rows.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    token_rows: torch.Tensor
    token_columns: torch.Tensor

    def params(self) -> PackedSeqParams:
        """Megatron's description of the packing (THD: one sequence dimension of concatenated sequences)."""
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def to(self, device: torch.device, *, non_blocking: bool = False) -> PackedSequences:
        move = lambda tensor: tensor.to(device, non_blocking=non_blocking)  # noqa: E731
        return PackedSequences(move(self.input_ids), move(self.labels), move(self.position_ids),
                               move(self.cu_seqlens), self.max_seqlen, move(self.token_rows), move(self.token_columns))


def pack_rows(rows: SequenceBatch, pad_to_multiple_of: int) -> PackedSequences:
    """Concatenate the real tokens of right-padded `rows` [n, s] into one row (see `PackedSequences`)."""
    lengths = rows.real_lengths()
    real = torch.arange(rows.input_ids.shape[1])[None, :] < lengths[:, None]  # [n, s]
    token_rows, token_columns = real.nonzero(as_tuple=True)  # row-major: sequence after sequence
    total = int(lengths.sum())
    padded = round_up(total, pad_to_multiple_of)
    segments = lengths.tolist() + ([padded - total] if padded > total else [])

    def packed(values: torch.Tensor) -> torch.Tensor:  # the tail's ids are 0: a segment of its own, no response label
        row = values.new_zeros((1, padded))
        row[0, :total] = values[token_rows, token_columns]
        return row

    return PackedSequences(
        input_ids=packed(rows.input_ids),
        labels=packed(rows.labels),
        position_ids=torch.cat([torch.arange(n) for n in segments])[None, :],
        cu_seqlens=torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32),
        max_seqlen=max(segments),
        token_rows=token_rows,
        token_columns=token_columns,
    )


@dataclass
class MicroBatch:
    """One forward/backward unit: `rows` (right-padded [n, s], what the loss sees), the rows of the parent batch
    they are (`row_index` [n] int64), and their packed form when packed (what the model sees)."""

    rows: SequenceBatch
    row_index: torch.Tensor
    packed: PackedSequences | None = None

    @property
    def model_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedSeqParams | None]:
        """(input_ids, position_ids, labels, packed_seq_params) as the model takes them: [n, s] each, or [1, T]
        each and the packing."""
        if self.packed is None:
            return self.rows.input_ids, self.rows.position_ids, self.rows.labels, None
        packed = self.packed
        return packed.input_ids, packed.position_ids, packed.labels, packed.params()

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values of `model_tokens`' labels as [n, s] rows (0 on padding); the identity unpacked.
        Differentiable."""
        if self.packed is None:
            return values
        rows = values.new_zeros(self.rows.input_ids.shape)
        real = values[0, : self.packed.token_rows.numel()]
        return rows.index_put((self.packed.token_rows, self.packed.token_columns), real)

    def to(self, device: torch.device, *, non_blocking: bool = False) -> MicroBatch:
        packed = None if self.packed is None else self.packed.to(device, non_blocking=non_blocking)
        return MicroBatch(self.rows.to(device, non_blocking=non_blocking), self.row_index, packed)
