"""paged_prefill_attention: a chunk of queries per sequence over its cached prefix and itself.

The chunk's own K/V are written to the cache first (write_kv_cache), so the kernel needs only the
block table: query i of a chunk of q_len at context ctx sits at absolute position ctx - q_len + i
and sees keys 0..that position (a bottom-right-aligned causal mask). The same kernel serves:
- a whole prompt (ctx == q_len), a later chunk of a chunked prefill (ctx > q_len),
- speculative verification: k + 1 query rows at the end of a long context.

Variable-length batches come in flat, as in the runner: the queries of sequence s are rows
query_starts[s]..query_starts[s + 1] of q [num_tokens, Hq, D].

Tiling: a program owns BLOCK_M rows = BLOCK_Q query tokens x the GROUP query heads of one KV head
(row r is token r // GROUP, head r % GROUP), so each K/V tile it reads serves every head of the group.
Prefill is compute-bound (each key is used by BLOCK_Q tokens), unlike decode.

Grid: (num_seqs, cdiv(max_q_len, BLOCK_Q), n_kv_heads); tiles past a sequence's own q_len do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._paged import load_rows, load_scales, lookup_slots, mma, online_softmax
from kvscope.kernels._util import LOG2E, NEG_BIG, default_tile, dot_in_fp32, pad16
from kvscope.kernels.reference import attend_reference, gather_reference


# ---- torch reference ------------------------------------------------------------------------------


def paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, query_starts, context_lens, scale,
                                      k_scale=None, v_scale=None) -> torch.Tensor:
    """q [T, Hq, D]; query_starts [S + 1]; context_lens [S]; block_tables [S, W] -> [T, Hq, Dv]."""
    out = q.new_empty(*q.shape[:2], v_cache.shape[-1])
    starts = query_starts.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        k = gather_reference(k_cache, block_tables[s], ctx, k_scale)  # [ctx, Hkv, D]
        v = gather_reference(v_cache, block_tables[s], ctx, v_scale)  # [ctx, Hkv, Dv]
        rows = slice(starts[s], starts[s + 1])
        out[rows] = attend_reference(q[rows], k, v, scale).to(q.dtype)
    return out


# ---- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, Hq, D]
    k_ptr, stride_kb, stride_ks, stride_kh,  # k_cache [num_blocks, block_size, Hkv, D]
    v_ptr, stride_vb, stride_vs, stride_vh,  # v_cache [num_blocks, block_size, Hkv, Dv]
    ks_ptr, vs_ptr, stride_sb, stride_ss, stride_sh,  # int8 scales [num_blocks, block_size, Hkv]
    table_ptr, stride_tb, starts_ptr, ctx_ptr,  # block_tables [S, W], query_starts [S + 1], context_lens [S]
    o_ptr, stride_ot, stride_oh,  # out [T, Hq, Dv]
    sm_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    QUANT: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq, q_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    first = q_tile * BLOCK_Q
    r = tl.arange(0, BLOCK_M)
    tok = first + r // GROUP  # query index within the chunk
    heads = kv_head * GROUP + r % GROUP
    rows_valid = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx - q_len + tok  # absolute position: the row sees keys 0..q_pos
    d, dv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rows_valid[:, None] & (d[None, :] < D), other=0.0)  # [BLOCK_M, D_PAD]
    # Keys up to the tile's last query; a tile past q_len reads none.
    key_end = tl.where(first < q_len, ctx - q_len + tl.minimum(first + BLOCK_Q, q_len), 0)
    table = table_ptr + seq * stride_tb
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    for tile in range(0, key_end, TILE):
        pos = tile + tl.arange(0, TILE)
        valid = pos < key_end
        block, slot = lookup_slots(table, pos, valid, BLOCK_SIZE)
        k = load_rows(k_head, stride_kb, stride_ks, block, slot, valid, d, D)  # [TILE, D_PAD]
        s = mma(q, tl.trans(k), q, DOT_F32)  # [BLOCK_M, TILE]
        if QUANT:
            s *= load_scales(ks_ptr + kv_head * stride_sh, stride_sb, stride_ss, block, slot, valid)[None, :]
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * (sm_scale * LOG2E), float("-inf"))
        p, alpha, m, l = online_softmax(s, m, l)
        if QUANT:
            p *= load_scales(vs_ptr + kv_head * stride_sh, stride_sb, stride_ss, block, slot, valid)[None, :]
        v = load_rows(v_head, stride_vb, stride_vs, block, slot, valid, dv, DV)  # [TILE, DV_PAD]
        acc = acc * alpha[:, None] + mma(p, v, q, DOT_F32)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o = o_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=rows_valid[:, None] & (dv[None, :] < DV))


def prefill_block_m(group: int) -> int:
    """Rows per program: ~16 query tokens x the group, at most 128 rows, at least the whole group."""
    return max(pad16(group), min(128, pad16(16 * group)))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            max_query_len: int | None = None, block_m: int | None = None,
                            tile: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, Dv]: sequence s's rows query_starts[s]..[s+1] attend causally to its
    context_lens[s] cached tokens (the chunk included). Caches and scales as in paged_decode_attention;
    query_starts [S + 1], context_lens [S] int32.
    """
    num_tokens, hq, d = q.shape
    _, block_size, hkv, dv = v_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    num_seqs = context_lens.shape[0]
    out = q.new_empty(num_tokens, hq, dv)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_starts[1:] - query_starts[:-1]).max())
    group = hq // hkv
    block_m = block_m or prefill_block_m(group)
    tile = tile or default_tile(q.dtype)
    block_q = block_m // group
    assert block_q >= 1, "block_m must hold the whole query-head group"
    quant = k_cache.dtype == torch.int8
    ks, vs = (k_scale, v_scale) if quant else (k_cache, k_cache)  # placeholders, never read
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_q), hkv)](
        q, q.stride(0), q.stride(1), k_cache, *k_cache.stride()[:3], v_cache, *v_cache.stride()[:3],
        ks, vs, *ks.stride()[:3], block_tables, block_tables.stride(0), query_starts, context_lens,
        out, out.stride(0), out.stride(1), scale,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, D=d, D_PAD=pad16(d), DV=dv, DV_PAD=pad16(dv),
        BLOCK_SIZE=block_size, TILE=tile, QUANT=quant, DOT_F32=dot_in_fp32(q.dtype),
    )
    return out
