"""paged_decode_attention: one query token per sequence over its whole paged context.

Decode reads every cached K/V byte of the sequence to produce one token, and does only about
`group` (query heads per KV head) FLOPs per byte read: it is memory-bound, so the design goals are
"read each K/V byte once" and "keep every SM streaming":

- GQA/MQA inside the kernel: one program owns one (sequence, KV head) and all the query heads of
  its group, padded to 16 rows for tl.dot. K/V are read once per group, never repeated in memory.
- Block-table indirection per token tile (kernels/_paged.py), online softmax across tiles.
- Split-K (flash-decoding): with few sequences, batch x KV heads programs cannot fill a GPU, so the
  context is also cut into splits, each its own program. Each writes a normalized partial output
  and its log-sum-exp; a second, tiny kernel combines the splits. With one split the first pass
  writes the final output directly and the second is skipped.
- int8 caches: K scales multiply the score columns after the dot and V scales the probabilities
  before it, so dequantizing costs [G, TILE] multiplies instead of [TILE, D].

Grid: (batch, n_kv_heads, num_splits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._paged import load_rows, load_scales, lookup_slots, mma, online_softmax
from kvscope.kernels._util import LOG2E, NEG_BIG, default_tile, dot_in_fp32, num_sms, pad16
from kvscope.kernels.reference import attend_reference, gather_reference

MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (Q load, partial write) outweighs its reads


# ---- torch reference ------------------------------------------------------------------------------


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale,
                                     k_scale=None, v_scale=None) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D|Dv]; block_tables [B, W]; context_lens [B]."""
    out = []
    for b, ctx in enumerate(context_lens.tolist()):
        k = gather_reference(k_cache, block_tables[b], ctx, k_scale)  # [ctx, Hkv, D]
        v = gather_reference(v_cache, block_tables[b], ctx, v_scale)  # [ctx, Hkv, Dv]
        out.append(attend_reference(q[b : b + 1], k, v, scale)[0])
    return torch.stack(out).to(q.dtype)  # [B, Hq, Dv]


# ---- Triton: pass 1, one split of one (sequence, KV head) -------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, Hq, D]
    k_ptr, stride_kb, stride_ks, stride_kh,  # k_cache [num_blocks, block_size, Hkv, D]
    v_ptr, stride_vb, stride_vs, stride_vh,  # v_cache [num_blocks, block_size, Hkv, Dv]
    ks_ptr, vs_ptr, stride_sb, stride_ss, stride_sh,  # int8 scales [num_blocks, block_size, Hkv]
    table_ptr, stride_tb, ctx_ptr,  # block_tables [B, W], context_lens [B]
    o_ptr, stride_ob, stride_oh, stride_os,  # partial out [B, Hq, num_splits, Dv] (or out itself)
    lse_ptr, stride_lb, stride_lh,  # log2-sum-exp [B, Hq, num_splits]
    sm_scale, split_len,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, QUANT: tl.constexpr,
    DOT_F32: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, G_PAD)
    heads = kv_head * GROUP + g  # the group's query heads, rows >= GROUP are padding
    d, dv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < GROUP) & (d[None, :] < D), other=0.0)  # [G_PAD, D_PAD]
    table = table_ptr + b * stride_tb
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    m = tl.full([G_PAD], NEG_BIG, tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    for tile in range(start, end, TILE):
        pos = tile + tl.arange(0, TILE)
        valid = pos < end
        block, slot = lookup_slots(table, pos, valid, BLOCK_SIZE)
        k = load_rows(k_head, stride_kb, stride_ks, block, slot, valid, d, D)  # [TILE, D_PAD]
        s = mma(q, tl.trans(k), q, DOT_F32)  # [G_PAD, TILE]
        if QUANT:
            s *= load_scales(ks_ptr + kv_head * stride_sh, stride_sb, stride_ss, block, slot, valid)[None, :]
        s = tl.where(valid[None, :], s * (sm_scale * LOG2E), float("-inf"))
        p, alpha, m, l = online_softmax(s, m, l)
        if QUANT:
            p *= load_scales(vs_ptr + kv_head * stride_sh, stride_sb, stride_ss, block, slot, valid)[None, :]
        v = load_rows(v_head, stride_vb, stride_vs, block, slot, valid, dv, DV)  # [TILE, DV_PAD]
        acc = acc * alpha[:, None] + mma(p, v, q, DOT_F32)
    store_split(acc, m, l, b, heads, g < GROUP, split, dv, DV, o_ptr, stride_ob, stride_oh, stride_os,
                lse_ptr, stride_lb, stride_lh, WRITE_LSE)


@triton.jit
def store_split(acc, m, l, b, heads, rows_valid, split, dv, DV: tl.constexpr, o_ptr, stride_ob, stride_oh,
                stride_os, lse_ptr, stride_lb, stride_lh, WRITE_LSE: tl.constexpr):
    """Write acc / l (an empty split, l = 0, writes zeros) and, when splitting, its log2-sum-exp."""
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o = o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + dv[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=rows_valid[:, None] & (dv[None, :] < DV))
    if WRITE_LSE:
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), NEG_BIG)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=rows_valid)


# ---- Triton: pass 2, combine the splits of one (sequence, query head) ------------------------------


@triton.jit
def combine_splits_kernel(
    part_ptr, stride_pb, stride_ph, stride_ps,  # partial out [B, H, num_splits, Dv] float32
    lse_ptr, stride_lb, stride_lh,  # [B, H, num_splits]
    o_ptr, stride_ob, stride_oh,  # out [B, H, Dv]
    num_splits, DV: tl.constexpr, DV_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    # grid: (B, H). Each split's output is already normalized by its own sum; reweighting by
    # exp2(lse_s - max) / sum turns them into the softmax over the whole context.
    b, h = tl.program_id(0), tl.program_id(1)
    s, dv = tl.arange(0, S_PAD), tl.arange(0, DV_PAD)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s < num_splits, other=NEG_BIG)
    w = tl.where(s < num_splits, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)  # [S_PAD]
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + dv[None, :],
                   mask=(s[:, None] < num_splits) & (dv[None, :] < DV), other=0.0)  # [S_PAD, DV_PAD]
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + dv, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


# ---- host side ------------------------------------------------------------------------------------


def plan_splits(batch: int, programs_per_seq: int, max_context_len: int, tile: int, device: torch.device,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len): enough programs for two waves over the SMs, splits of >= 256 tokens.

    split_len is a multiple of the tile, and no split lies wholly past the longest context.
    """
    if num_splits is None:
        want = triton.cdiv(2 * num_sms(device), max(1, batch * programs_per_seq))
        num_splits = max(1, min(want, triton.cdiv(max_context_len, MIN_SPLIT_TOKENS), 64))
    split_len = triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), tile) * tile
    return triton.cdiv(max(max_context_len, 1), split_len), split_len


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1's outputs: with one split, `out` itself (viewed [B, H, 1, Dv]); else fp32 partials."""
    b, h, dv = out.shape
    if num_splits == 1:
        return out.unsqueeze(2), out.new_empty(1, 1, 1, dtype=torch.float32)
    return (torch.empty(b, h, num_splits, dv, dtype=torch.float32, device=out.device),
            torch.empty(b, h, num_splits, dtype=torch.float32, device=out.device))


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    b, h, num_splits, dv = part.shape
    if num_splits == 1:
        return
    combine_splits_kernel[(b, h)](part, *part.stride()[:3], lse, *lse.stride()[:2], out, *out.stride()[:2],
                                  num_splits, DV=dv, DV_PAD=pad16(dv), S_PAD=pad16(num_splits))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           max_context_len: int | None = None, num_splits: int | None = None,
                           tile: int | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, Dv]: each row attends to its context_lens[b] cached tokens.

    k_cache/v_cache [num_blocks, block_size, Hkv, D|Dv] (int8 with k_scale/v_scale
    [num_blocks, block_size, Hkv]); block_tables [B, W] int32; context_lens [B] int32, each >= 1.
    num_splits None picks split-K from the device's SM count (1 on CPU).
    """
    bsz, hq, d = q.shape
    _, block_size, hkv, dv = v_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    quant = k_cache.dtype == torch.int8
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if bsz else 0
    out = q.new_empty(bsz, hq, dv)
    if bsz == 0:
        return out
    tile = tile or default_tile(q.dtype)
    splits, split_len = plan_splits(bsz, hkv, max_context_len, tile, q.device, num_splits)
    part, lse = split_buffers(out, splits)
    ks, vs = (k_scale, v_scale) if quant else (k_cache, k_cache)  # placeholders, never read
    group = hq // hkv
    _decode_split_kernel[(bsz, hkv, splits)](
        q, q.stride(0), q.stride(1), k_cache, *k_cache.stride()[:3], v_cache, *v_cache.stride()[:3],
        ks, vs, *ks.stride()[:3], block_tables, block_tables.stride(0), context_lens,
        part, *part.stride()[:3], lse, *lse.stride()[:2], scale, split_len,
        GROUP=group, G_PAD=pad16(group), D=d, D_PAD=pad16(d), DV=dv, DV_PAD=pad16(dv), BLOCK_SIZE=block_size,
        TILE=tile, QUANT=quant, DOT_F32=dot_in_fp32(q.dtype), WRITE_LSE=splits > 1,
    )
    combine_splits(part, lse, out)
    return out
