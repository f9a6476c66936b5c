"""Tile sizes for the fused LM-head kernels: GPU defaults, and large tiles for the CPU interpreter."""

from __future__ import annotations

from dataclasses import dataclass

import triton
from triton import knobs


@dataclass(frozen=True)
class TileConfig:
    """Block sizes of the token (N), vocab (V) and hidden (H) tile dimensions (powers of two, >= 16).

    min_programs: the forward splits the vocabulary until the grid has at least this many programs
    (each split yields its own statistics, merged like tensor-parallel shards).
    """

    block_n: int = 64
    block_v: int = 128
    block_h: int = 64
    num_warps: int = 8
    min_programs: int = 264  # two waves on an H100/H200 (132 SMs)

    def vocab_splits(self, n: int, v: int) -> int:
        token_tiles = triton.cdiv(n, self.block_n)
        return max(1, min(triton.cdiv(v, self.block_v), triton.cdiv(self.min_programs, token_tiles)))


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before the kernels were defined)."""
    return bool(knobs.runtime.interpret)


def default_tiles(n: int, v: int, h: int) -> TileConfig:
    """GPU defaults; under the interpreter, tiles as large as the problem (fewer, vectorised numpy steps)."""
    if not interpreting():
        return TileConfig()
    size = lambda dim, cap: max(16, min(triton.next_power_of_2(dim), cap))  # noqa: E731
    return TileConfig(block_n=size(n, 64), block_v=size(v, 2048), block_h=size(h, 128), num_warps=1, min_programs=1)
