"""Device functions the paged attention kernels share: reading a tile of tokens through a block
table, and one step of the online softmax.

Why tokens, not blocks: tl.arange and tl.dot want power-of-two tiles of at least 16, while the
engine's block size may be anything from 1 to 256. So a tile is TILE consecutive token positions;
each position finds its block (`table[pos // BLOCK_SIZE]`) and its slot in it
(`pos % BLOCK_SIZE`). With BLOCK_SIZE a multiple of TILE a tile lies in one block and the loads
are contiguous rows; otherwise it spans several blocks and is a gather, which is still one row of
D numbers per token.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lookup_slots(table_row_ptr, pos, valid, BLOCK_SIZE: tl.constexpr):
    """Where token positions pos [TILE] live: (block id [TILE] int64, slot in that block [TILE]).

    One int32 load per token from the sequence's block table; K, V and scales then share it.
    """
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block, pos % BLOCK_SIZE


@triton.jit
def load_rows(cache_ptr, stride_b, stride_s, block, slot, valid, col, ncols: tl.constexpr):
    """cache[block, slot, <head already in cache_ptr>, col] -> [TILE, COLS], zeros where masked."""
    row = block * stride_b + slot * stride_s  # [TILE]
    mask = valid[:, None] & (col[None, :] < ncols)
    return tl.load(cache_ptr + row[:, None] + col[None, :], mask=mask, other=0)


@triton.jit
def load_scales(scale_ptr, stride_b, stride_s, block, slot, valid):
    """int8 caches: each token's scale [TILE] float32 (0 where masked, so NaN garbage never leaks)."""
    return tl.load(scale_ptr + block * stride_b + slot * stride_s, mask=valid, other=0.0)


@triton.jit
def online_softmax(s, m, l):
    """Fold a tile of log2-scaled scores s [M, TILE] into the running max m and sum l [M].

    Returns (p, alpha, m_new, l_new): the tile's unnormalized probabilities, and the factor by which
    the accumulator built so far must shrink (its max was m, now it is m_new).
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def mma(a, b, like, DOT_F32: tl.constexpr):
    """a [M, K] @ b [K, N] accumulated in fp32, both operands in the dtype of `like` (the query).

    DOT_F32: upcast both and use IEEE fp32 (the interpreter's bf16 dot is wrong; fp32 models on a
    GPU must not silently drop to tf32). Otherwise fp16/bf16 tensor cores; an int8 cache tile is
    converted here, exactly (codes within +-127 are exact in fp16 and bf16).
    """
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(like.dtype), b.to(like.dtype))
