"""mla_decode_attention: decode over MLA's latent cache, in the absorbed form.

The cache holds one row per token, [kv_lora_rank latent | qk_rope_head_dim RoPE key], shared by every
query head (a single wide KV head). The absorbed query is [latent part | rope part] per head, and the
value is the latent part of the same row. So each token's row is read once and used twice: for the
score (latent . q_latent + rope . q_rope) and as the value. The generic decode kernel would read the
latent twice (once as K, once as V).

All query heads share the one KV head, so the group would be every head (128 in DeepSeek-V2): too
many rows for one program's registers at a latent width of 512. Heads are taken 16 at a time
(tl.dot's minimum M) and each head group re-reads the latent; split-K over the context fills the GPU
when the batch is small, with the same combine pass as paged_decode_attention.

Grid: (batch, cdiv(n_heads, HEADS), num_splits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._paged import load_rows, lookup_slots, mma, online_softmax
from kvscope.kernels._util import LOG2E, NEG_BIG, default_tile, dot_in_fp32, pad16
from kvscope.kernels.paged_decode import (combine_splits, paged_decode_attention_reference, plan_splits, split_buffers,
                                  store_split)

HEADS_PER_PROGRAM = 16  # tl.dot's minimum M; the accumulator is [16, kv_lora_rank] fp32


# ---- torch reference ------------------------------------------------------------------------------


def mla_decode_attention_reference(q, cache, block_tables, context_lens, kv_lora_rank, scale) -> torch.Tensor:
    """q [B, H, R + P]; cache [num_blocks, block_size, 1, R + P] -> [B, H, R]: MQA, value = latent."""
    return paged_decode_attention_reference(q, cache, cache[..., :kv_lora_rank], block_tables, context_lens, scale)


# ---- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, H, R + P]
    c_ptr, stride_cb, stride_cs,  # cache [num_blocks, block_size, 1, R + P]
    table_ptr, stride_tb, ctx_ptr,  # block_tables [B, W], context_lens [B]
    o_ptr, stride_ob, stride_oh, stride_os,  # partial out [B, H, num_splits, R] (or out itself)
    lse_ptr, stride_lb, stride_lh,  # [B, H, num_splits]
    sm_scale, split_len, num_heads,
    R: tl.constexpr, R_PAD: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DOT_F32: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    b, head_group, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    heads = head_group * HEADS + tl.arange(0, HEADS)
    rows_valid = heads < num_heads
    r, p_col = tl.arange(0, R_PAD), tl.arange(0, P_PAD)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=rows_valid[:, None] & (r[None, :] < R), other=0.0)  # [HEADS, R_PAD]
    q_rope = tl.load(q_row + R + p_col[None, :], mask=rows_valid[:, None] & (p_col[None, :] < P), other=0.0)
    table = table_ptr + b * stride_tb
    m = tl.full([HEADS], NEG_BIG, tl.float32)
    l = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, R_PAD], tl.float32)
    for tile in range(start, end, TILE):
        pos = tile + tl.arange(0, TILE)
        valid = pos < end
        block, slot = lookup_slots(table, pos, valid, BLOCK_SIZE)
        lat = load_rows(c_ptr, stride_cb, stride_cs, block, slot, valid, r, R)  # [TILE, R_PAD]
        rope = load_rows(c_ptr + R, stride_cb, stride_cs, block, slot, valid, p_col, P)  # [TILE, P_PAD]
        s = mma(q_lat, tl.trans(lat), q_lat, DOT_F32) + mma(q_rope, tl.trans(rope), q_lat, DOT_F32)
        s = tl.where(valid[None, :], s * (sm_scale * LOG2E), float("-inf"))  # [HEADS, TILE]
        p, alpha, m, l = online_softmax(s, m, l)
        acc = acc * alpha[:, None] + mma(p, lat, q_lat, DOT_F32)  # the latent tile is the value
    store_split(acc, m, l, b, heads, rows_valid, split, r, R, o_ptr, stride_ob, stride_oh, stride_os,
                lse_ptr, stride_lb, stride_lh, WRITE_LSE)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, kv_lora_rank: int, scale: float,
                         max_context_len: int | None = None, num_splits: int | None = None,
                         tile: int | None = None) -> torch.Tensor:
    """q [B, H, R + P] (absorbed: latent part, rope part) -> [B, H, R] in the latent space.

    cache [num_blocks, block_size, 1, R + P]; block_tables [B, W] and context_lens [B] int32.
    """
    bsz, heads, width = q.shape
    _, block_size, kv_heads, cache_width = cache.shape
    assert kv_heads == 1 and cache_width == width and cache.stride(-1) == 1 and q.stride(-1) == 1
    rank, rope = kv_lora_rank, width - kv_lora_rank
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if bsz else 0
    out = q.new_empty(bsz, heads, rank)
    if bsz == 0:
        return out
    head_groups = triton.cdiv(heads, HEADS_PER_PROGRAM)
    tile = tile or default_tile(q.dtype) // 2  # latent rows are 4x a usual head: half the tokens per tile
    splits, split_len = plan_splits(bsz, head_groups, max_context_len, tile, q.device, num_splits)
    part, lse = split_buffers(out, splits)
    _mla_decode_split_kernel[(bsz, head_groups, splits)](
        q, q.stride(0), q.stride(1), cache, cache.stride(0), cache.stride(1),
        block_tables, block_tables.stride(0), context_lens,
        part, *part.stride()[:3], lse, *lse.stride()[:2], scale, split_len, heads,
        R=rank, R_PAD=pad16(rank), P=rope, P_PAD=pad16(rope), HEADS=HEADS_PER_PROGRAM, BLOCK_SIZE=block_size,
        TILE=tile, DOT_F32=dot_in_fp32(q.dtype), WRITE_LSE=splits > 1,
    )
    combine_splits(part, lse, out)
    return out
