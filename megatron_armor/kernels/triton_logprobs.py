"""Triton kernels for the LM head's log-softmax statistics and their gradients, tile by tile.

Each kernel recomputes logit tiles z = (h @ w.T) / T of shape [BLOCK_N, BLOCK_V] from `hidden` [N, H]
and the vocab shard `weight` [V, H] (fp32 accumulation over H in BLOCK_H chunks); no kernel
writes anything of size [N, V]. The kernels' V is the number of valid (non-padding) rows at the top of
the shard: rows past it are never loaded. The launchers here take and return plain tensors; combining
statistics across vocab splits / tensor-parallel ranks and autograd live in `fused.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_armor.kernels.tiles import TileConfig, interpreting


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b in fp32. DOT: "ieee" (fp32 operands, no TF32), "native" (16-bit tensor cores), "upcast"
    (16-bit operands multiplied in fp32 -- exact products, same result -- for the CPU interpreter, whose
    dot mishandles bfloat16)."""
    if DOT == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif DOT == "ieee":
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _load_chunk(ptr, rows, ks, n_rows, H, stride):
    """ptr[rows, ks] of a row-major [n_rows, H] matrix with row stride `stride`; 0 outside it."""
    mask = (rows[:, None] < n_rows) & (ks[None, :] < H)
    return tl.load(ptr + rows[:, None] * stride + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _add_chunk(ptr, rows, ks, n_rows, H, a, b, DOT: tl.constexpr):
    """ptr[rows, ks] += a @ b on a contiguous fp32 [n_rows, H] buffer whose `rows` this program owns."""
    mask = (rows[:, None] < n_rows) & (ks[None, :] < H)
    out = ptr + rows[:, None] * H + ks[None, :]
    tl.store(out, _dot(a, b, tl.load(out, mask=mask, other=0.0), DOT), mask=mask)


@triton.jit
def _logit_tile(h_ptr, w_ptr, rows, cols, N, V, H, stride_h, stride_w, inv_temp,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT: tl.constexpr):
    """z[rows, cols] / T in fp32; columns past V are -inf so they never enter a max or a sum."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        h = _load_chunk(h_ptr, rows, ks, N, H, stride_h)
        w = _load_chunk(w_ptr, cols, ks, V, H, stride_w)
        acc = _dot(h, tl.trans(w), acc, DOT)
    return tl.where(cols[None, :] < V, acc * inv_temp, float("-inf"))


@triton.jit
def _stats_kernel(h_ptr, w_ptr, label_ptr, max_ptr, sumexp_ptr, shifted_ptr, target_ptr,
                  N, V, H, stride_h, stride_w, inv_temp, vocab_per_split,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT: tl.constexpr):
    """Per (token, vocab split): max m, sum e^(z-m), sum e^(z-m) (z-m), and the target logit (0 if elsewhere)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    labels = tl.load(label_ptr + rows, mask=rows < N, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    target = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v_begin = split * vocab_per_split
    v_end = tl.minimum(v_begin + vocab_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = _logit_tile(h_ptr, w_ptr, rows, cols, N, v_end, H, stride_h, stride_w, inv_temp,
                        BLOCK_N, BLOCK_V, BLOCK_H, DOT)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shifted = z - m_new[:, None]
        e = tl.exp(shifted)  # 0 on the -inf padding columns
        scale = tl.exp(m - m_new)
        # sum e^(z-m)(z-m) rebased onto m_new; s == 0 before the first tile (where m = -inf).
        a = scale * (a + (tl.where(s > 0, m, m_new) - m_new) * s) + tl.sum(e * tl.where(e > 0, shifted, 0.0), axis=1)
        s = scale * s + tl.sum(e, axis=1)
        m = m_new
        target += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
    out = split * N + rows
    tl.store(max_ptr + out, m, mask=rows < N)
    tl.store(sumexp_ptr + out, s, mask=rows < N)
    tl.store(shifted_ptr + out, a, mask=rows < N)
    tl.store(target_ptr + out, target, mask=rows < N)


@triton.jit
def _grad_logit_tile(z, cols, labels, lse, g_lp, g_ent, entropy, inv_temp, filter_eps,
                     HAS_ENTROPY: tl.constexpr, FILTER: tl.constexpr):
    """d loss / d (h @ w.T) on one tile, and whether the tile matters (False only when FILTER skips it).

    dz = g_lp (onehot - p) - g_ent p (log p + entropy), p = e^(z - lse); padding columns give 0.
    """
    shifted = z - lse[:, None]
    p = tl.exp(shifted)
    coef = -g_lp[:, None]
    if HAS_ENTROPY:
        coef = coef - g_ent[:, None] * (tl.where(p > 0, shifted, 0.0) + entropy[:, None])
    dz = p * coef + tl.where(cols[None, :] == labels[:, None], g_lp[:, None], 0.0)
    keep = True
    if FILTER:
        scale = tl.abs(g_lp)
        if HAS_ENTROPY:
            scale += tl.abs(g_ent)
        keep = tl.max(tl.where(tl.abs(dz) > filter_eps * scale[:, None], 1, 0)) > 0
    return dz * inv_temp, keep


@triton.jit
def _load_token_coefs(label_ptr, lse_ptr, g_lp_ptr, g_ent_ptr, ent_ptr, rows, N, HAS_ENTROPY: tl.constexpr):
    """labels, lse, g_lp, g_ent, entropy for `rows` (zeros past N, so those rows get zero gradient)."""
    valid = rows < N
    labels = tl.load(label_ptr + rows, mask=valid, other=-1)
    lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=valid, other=0.0)
    if HAS_ENTROPY:
        g_ent = tl.load(g_ent_ptr + rows, mask=valid, other=0.0)
        entropy = tl.load(ent_ptr + rows, mask=valid, other=0.0)
    else:
        g_ent = tl.zeros_like(lse)
        entropy = tl.zeros_like(lse)
    return labels, lse, g_lp, g_ent, entropy


@triton.jit
def _grad_hidden_kernel(h_ptr, w_ptr, label_ptr, lse_ptr, g_lp_ptr, g_ent_ptr, ent_ptr, gh_ptr,
                        N, V, H, stride_h, stride_w, inv_temp, filter_eps,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT: tl.constexpr,
                        HAS_ENTROPY: tl.constexpr, FILTER: tl.constexpr):
    """grad_hidden[rows] (fp32 [N, H], zero-initialised) += dz @ w over the vocab; this program owns `rows`."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    labels, lse, g_lp, g_ent, entropy = _load_token_coefs(label_ptr, lse_ptr, g_lp_ptr, g_ent_ptr, ent_ptr, rows, N,
                                                          HAS_ENTROPY)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = _logit_tile(h_ptr, w_ptr, rows, cols, N, V, H, stride_h, stride_w, inv_temp, BLOCK_N, BLOCK_V, BLOCK_H, DOT)
        dz, keep = _grad_logit_tile(z, cols, labels, lse, g_lp, g_ent, entropy, inv_temp, filter_eps,
                                    HAS_ENTROPY, FILTER)
        if keep:
            for k0 in range(0, H, BLOCK_H):
                ks = k0 + tl.arange(0, BLOCK_H)
                w = _load_chunk(w_ptr, cols, ks, V, H, stride_w)
                _add_chunk(gh_ptr, rows, ks, N, H, dz.to(w.dtype), w, DOT)


@triton.jit
def _grad_weight_kernel(h_ptr, w_ptr, label_ptr, lse_ptr, g_lp_ptr, g_ent_ptr, ent_ptr, gw_ptr,
                        N, V, H, stride_h, stride_w, inv_temp, filter_eps,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT: tl.constexpr,
                        HAS_ENTROPY: tl.constexpr, FILTER: tl.constexpr):
    """grad_weight[cols] (fp32, row stride H) += dz.T @ h, looping over tokens; deterministic. Adds to what the
    buffer holds (zeros, or Megatron's main_grad); rows past V are not touched."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        labels, lse, g_lp, g_ent, entropy = _load_token_coefs(label_ptr, lse_ptr, g_lp_ptr, g_ent_ptr, ent_ptr, rows, N,
                                                          HAS_ENTROPY)
        z = _logit_tile(h_ptr, w_ptr, rows, cols, N, V, H, stride_h, stride_w, inv_temp, BLOCK_N, BLOCK_V, BLOCK_H, DOT)
        dz, keep = _grad_logit_tile(z, cols, labels, lse, g_lp, g_ent, entropy, inv_temp, filter_eps,
                                    HAS_ENTROPY, FILTER)
        if keep:
            for k0 in range(0, H, BLOCK_H):
                ks = k0 + tl.arange(0, BLOCK_H)
                h = _load_chunk(h_ptr, rows, ks, N, H, stride_h)
                _add_chunk(gw_ptr, cols, ks, V, H, tl.trans(dz).to(h.dtype), h, DOT)


@dataclass(frozen=True)
class ShardStats:
    """Per-token softmax statistics of one vocab shard, one row per vocab split: each [splits, N] float32.

    max: max_v z; sumexp: sum e^(z - max); shifted: sum e^(z - max) (z - max); target: z[label] (0 when the
    label is not in this split).
    """

    max: torch.Tensor
    sumexp: torch.Tensor
    shifted: torch.Tensor
    target: torch.Tensor


def _dot_mode(dtype: torch.dtype) -> str:
    """The `_dot` mode: fp32 inputs keep fp32 products (no TF32); 16-bit inputs use the tensor cores."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if interpreting() else "native"


def shard_stats(hidden: torch.Tensor, weight: torch.Tensor, valid_rows: int, local_labels: torch.Tensor,
                temperature: float, tiles: TileConfig) -> ShardStats:
    """Forward statistics over the first `valid_rows` rows of the shard (the rest, vocabulary padding, are never
    read). hidden [N, H], weight [V, H] (same dtype, rows contiguous); local_labels [N] int64 (index into this
    shard, -1 for none). A shard without valid rows gives one split with max -inf and zero sums."""
    n, h = hidden.shape
    if valid_rows == 0:
        out = torch.zeros(4, 1, n, dtype=torch.float32, device=hidden.device)
        out[0] = float("-inf")
        return ShardStats(*out)
    splits = tiles.vocab_splits(n, valid_rows)
    per_split = triton.cdiv(triton.cdiv(valid_rows, splits), tiles.block_v) * tiles.block_v
    splits = triton.cdiv(valid_rows, per_split)
    out = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(n, tiles.block_n), splits)
    _stats_kernel[grid](
        hidden, weight, local_labels, out[0], out[1], out[2], out[3],
        n, valid_rows, h, hidden.stride(0), weight.stride(0), 1.0 / temperature, per_split,
        BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, DOT=_dot_mode(hidden.dtype),
        num_warps=tiles.num_warps,
    )
    return ShardStats(*out)


def shard_grads(hidden: torch.Tensor, weight: torch.Tensor, valid_rows: int, local_labels: torch.Tensor,
                lse: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, entropy: torch.Tensor,
                temperature: float, tiles: TileConfig, filter_eps: float | None,
                weight_grad_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden [N, H] float32 from this shard only, grad_weight [V, H] float32).

    Only the first `valid_rows` rows of `weight` are vocabulary: the padding rows are never read and their
    gradient rows stay untouched (0 in a fresh buffer). lse, grad_logp, grad_entropy, entropy: [N] float32
    over the full vocabulary (grad_logp already 0 on ignored labels). filter_eps skips tiles where every
    |dz| <= filter_eps * (|g_lp| + |g_ent|) of its token. weight_grad_out: a contiguous float32 [V, H]
    buffer (Megatron's main_grad) the weight gradient is added into and returned as grad_weight; None
    allocates a zeroed one.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    grad_hidden = torch.zeros(n, h, dtype=torch.float32, device=hidden.device)
    if weight_grad_out is None:
        weight_grad_out = torch.zeros(v, h, dtype=torch.float32, device=hidden.device)
    has_entropy = grad_entropy is not None
    args = (hidden, weight, local_labels, lse, grad_logp, grad_entropy if has_entropy else grad_logp, entropy)
    scalars = (n, valid_rows, h, hidden.stride(0), weight.stride(0), 1.0 / temperature, filter_eps or 0.0)
    meta = dict(BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h, DOT=_dot_mode(hidden.dtype),
                HAS_ENTROPY=has_entropy, FILTER=filter_eps is not None, num_warps=tiles.num_warps)
    _grad_hidden_kernel[(triton.cdiv(n, tiles.block_n),)](*args, grad_hidden, *scalars, **meta)
    _grad_weight_kernel[(triton.cdiv(valid_rows, tiles.block_v),)](*args, weight_grad_out, *scalars, **meta)
    return grad_hidden, weight_grad_out
