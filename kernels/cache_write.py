"""write_kv_cache: scatter this step's new K/V rows into their cache slots.

A slot is `block_id * block_size + offset`; the runner's slot mapping gives one per new token (a
negative slot means "padding, write nothing"). The cache is viewed as `[num_slots, n_kv_heads,
head_dim]`, so the scatter is one row copy per (token, KV head) and needs no block table.

int8 KV: each (token, KV head) row is quantized on the way in with its own scale,
`scale = max|x| / 127`, `q = floor(x / scale + 0.5)`; the scales live beside the blocks in
`[num_blocks, block_size, n_kv_heads]` float32 tensors and the attention kernels dequantize in their
inner loop. One scale per row keeps an outlier token from flattening every other token's values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._util import pad16

INT8_MAX = 127.0


# ---- torch reference ------------------------------------------------------------------------------


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scale [...]): symmetric, one scale per row."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(x / safe[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k [N, Hkv, D], v [N, Hkv, Dv] into caches [num_blocks, block_size, Hkv, D|Dv] at slots [N]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache is None:
            continue
        rows = x[keep]
        if scales is not None:
            rows, s = quantize_int8_reference(rows)
            scales.view(-1, scales.shape[-1])[slots] = s
        cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)


# ---- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _store_rows(x_ptr, stride_xn, stride_xh, cache_ptr, stride_cs, stride_ch, scale_ptr, stride_ss, stride_sh,
                tokens, slots, head, D: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr):
    """Copy rows x[tokens, head, :D] to cache[slots, head, :D], quantizing when QUANT."""
    d = tl.arange(0, D_PAD)
    valid = slots >= 0
    mask = valid[:, None] & (d[None, :] < D)
    rows = tl.load(x_ptr + tokens[:, None] * stride_xn + head * stride_xh + d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + slots.to(tl.int64)[:, None] * stride_cs + head * stride_ch + d[None, :]
    if QUANT:
        rows = rows.to(tl.float32)
        scale = tl.max(tl.abs(rows), axis=1) / 127.0  # [T]
        safe = tl.where(scale > 0, scale, 1.0)
        q = tl.floor(rows / safe[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(dst, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + slots.to(tl.int64) * stride_ss + head * stride_sh, scale, mask=valid)
    else:
        tl.store(dst, rows.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh,  # new rows [N, Hkv, D|Dv]
    k_cache_ptr, v_cache_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch,  # caches as [slots, Hkv, D]
    k_scale_ptr, v_scale_ptr, stride_kss, stride_ksh, stride_vss, stride_vsh,  # scales as [slots, Hkv]
    slot_ptr, num_tokens,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_V: tl.constexpr, QUANT: tl.constexpr,
):
    # grid: (cdiv(num_tokens, BLOCK_T), n_kv_heads): a tile of tokens of one KV head per program.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1)
    _store_rows(k_ptr, stride_kn, stride_kh, k_cache_ptr, stride_kcs, stride_kch, k_scale_ptr, stride_kss,
                stride_ksh, tokens, slots, head, D, D_PAD, QUANT)
    if HAS_V:
        _store_rows(v_ptr, stride_vn, stride_vh, v_cache_ptr, stride_vcs, stride_vch, v_scale_ptr, stride_vss,
                    stride_vsh, tokens, slots, head, DV, DV_PAD, QUANT)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, block_t: int = 16) -> None:
    """k [N, Hkv, D], v [N, Hkv, Dv] (None for MLA's single plane) -> caches at slot_mapping [N].

    Caches are [num_blocks, block_size, Hkv, D]; int8 caches need k_scale/v_scale
    [num_blocks, block_size, Hkv] float32.
    """
    n, heads, d = k.shape
    if n == 0:
        return
    for c in (k_cache, v_cache, k_scale, v_scale):  # slots are flat: blocks must follow one another
        assert c is None or c.stride(0) == c.shape[1] * c.stride(1), "cache blocks must be evenly strided"
    assert all(t.stride(-1) == 1 for t in (k, v, k_cache, v_cache) if t is not None), "rows must be contiguous"
    quant = k_cache.dtype == torch.int8
    assert not quant or (k_scale is not None and (v_cache is None or v_scale is not None)), "int8 needs scales"
    has_v = v_cache is not None
    v, v_cache = (v, v_cache) if has_v else (k, k_cache)  # placeholders: HAS_V=False never touches them
    k_scale = k_scale if quant else k_cache  # placeholders when not quantizing
    v_scale = v_scale if quant and has_v else k_scale
    dv = v.shape[-1]
    _write_kv_kernel[(triton.cdiv(n, block_t), heads)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache, v_cache, k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        k_scale, v_scale, k_scale.stride(1), k_scale.stride(2), v_scale.stride(1), v_scale.stride(2),
        slot_mapping, n,
        D=d, DV=dv, D_PAD=pad16(d), DV_PAD=pad16(dv), BLOCK_T=block_t, HAS_V=has_v, QUANT=quant,
    )
