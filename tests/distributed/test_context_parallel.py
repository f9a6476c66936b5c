"""The zig-zag layout of context parallelism: the split and its inverse (of one sequence, and of a packed row sequence
by sequence), and the per-chunk causal attention each CP rank computes (its queries over the whole sequence's keys)
against plain causal attention of the whole sequence.
The multi-process steps (CP=2, CP=2 x TP=2) are in tests/trainer/test_parallel_layouts.py."""

import pytest
import torch
import torch.nn.functional as F

from megatron_armor.distributed.context_parallel import ZigZag
from megatron_armor.distributed.init import _check_world_size


def test_chunks_are_zig_zag():
    """S=16 over CP=2: 4 chunks of 4; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert ZigZag(2, 0).positions(16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert ZigZag(2, 1).positions(16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert ZigZag(4, 3).positions(8).tolist() == [3, 4]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_split_and_restore_round_trip(size):
    seq_len = ZigZag(size, 0).padded_length(21, multiple=2)
    assert seq_len % (4 * size) == 0 and 21 <= seq_len < 21 + 4 * size
    whole = torch.randn(3, seq_len, 5)
    pieces = [ZigZag(size, rank).split(whole, 1) for rank in range(size)]
    assert all(piece.shape == (3, seq_len // size, 5) for piece in pieces)
    torch.testing.assert_close(ZigZag(size, 0).restore(torch.cat(pieces, 1), 1), whole, rtol=0, atol=0)
    # every position is held by exactly one rank
    held = torch.cat([ZigZag(size, rank).positions(seq_len) for rank in range(size)])
    assert sorted(held.tolist()) == list(range(seq_len))


def test_unsplittable_length_is_refused():
    with pytest.raises(ValueError, match="does not split into 2 x 2 zig-zag chunks; pad it to 8"):
        ZigZag(2, 0).split(torch.zeros(6), 0)
    with pytest.raises(ValueError, match="CP rank 2 is outside a group of 2"):
        ZigZag(2, 2)


def test_a_context_parallel_size_that_does_not_divide_the_processes_is_refused():
    """Start-up (`initialize_distributed`): 4 processes hold no TP 1 x PP 1 x CP 3 replica; 4 processes are not
    TP 1 x PP 1 x CP 2 x DP 1. (`armor plan` refuses CP groups that do not tile --gpus: tests/planning/test_planner.py.)"""
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by tensor_parallel_size \(1\) x "
                                         r"pipeline_parallel_size \(1\) x context_parallel_size \(3\)"):
        _check_world_size(4, 1, 1, 3, None)
    with pytest.raises(ValueError, match=r"context_parallel_size \(2\) x data_parallel_size \(1\) = 2"):
        _check_world_size(4, 1, 1, 2, 1)


@pytest.mark.parametrize("size", [2, 3])
def test_per_chunk_causal_mask_matches_whole_sequence_attention(size):
    """Each rank's queries attending to the (gathered) whole sequence's keys at global positions up to their own
    give that rank's rows of plain causal attention over the whole sequence, as `SDPAttention` computes them."""
    from megatron_armor.models.attention import SDPAttention

    g = torch.Generator().manual_seed(0)
    seq_len, batch, heads, groups, dim = 4 * size, 2, 4, 2, 8
    query = torch.randn(seq_len, batch, heads, dim, generator=g)
    key, value = (torch.randn(seq_len, batch, groups, dim, generator=g) for _ in range(2))
    repeat = lambda t: t.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)  # noqa: E731
    whole = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), repeat(key), repeat(value), is_causal=True)
    whole = whole.permute(2, 0, 1, 3).reshape(seq_len, batch, heads * dim)  # [S, b, heads * d]
    attention = SDPAttention.__new__(SDPAttention)  # the mask arithmetic alone: no config, no process group
    attention.dropout_p, attention.softmax_scale = 0.0, dim ** -0.5
    torch.nn.Module.__init__(attention)
    for rank in range(size):
        layout = ZigZag(size, rank)
        masked = layout.causal_mask(seq_len)
        assert masked.shape == (2 * seq_len // (2 * size), seq_len) and (~masked).sum(1).tolist() == [
            p + 1 for p in layout.positions(seq_len).tolist()]  # each query sees the keys up to its own position
        local = attention._attend(layout.split(query, 0), key, value, masked[None, None], causal=False)
        torch.testing.assert_close(local, layout.split(whole, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [2, 3])
def test_packed_rows_split_sequence_by_sequence(size):
    """A packed row (THD) of sequences each a multiple of 2 x size long: every rank holds its zig-zag chunks of every
    sequence, in sequence order, and the ranks' pieces restore the row."""
    lengths = [4 * size, 2 * size, 6 * size]
    cu_seqlens = [0, 4 * size, 6 * size, 12 * size]
    row = torch.randn(2, cu_seqlens[-1])
    pieces = [ZigZag(size, rank).split(row, 1, cu_seqlens) for rank in range(size)]
    for rank, piece in enumerate(pieces):
        layout, start = ZigZag(size, rank), 0
        for begin, n in zip(cu_seqlens, lengths):  # each sequence's chunks as the unpacked split gives them
            local = n // size
            torch.testing.assert_close(piece[:, start:start + local], layout.split(row[:, begin:begin + n], 1),
                                       rtol=0, atol=0)
            start += local
    torch.testing.assert_close(ZigZag(size, 0).restore(torch.cat(pieces, 1), 1, cu_seqlens), row, rtol=0, atol=0)
