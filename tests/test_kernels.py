"""Every Triton kernel against its torch reference, on the CPU under TRITON_INTERPRET=1.

The interpreter runs each program in numpy: exact for fp32/fp16, slow (~ms per tile step), so the
shapes are tiny and hypothesis draws few examples, but over the axes that break paged kernels:
block sizes 1..32 (powers of two or not), head ratios 1, 4, 8 and MQA, ragged contexts including 1
and exact block multiples, head dims that are not powers of two, fp32/fp16/bf16 and int8 caches,
split-K on and off.

Every cache slot that no sequence owns, and every padding entry of a block table, holds NaN (int8
caches: a NaN scale). A kernel that reads one without masking it turns its output into NaN.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

from dataclasses import dataclass

import pytest

pytest.importorskip("triton")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.kernels.cache_write import (dequantize_int8_reference, quantize_int8_reference, write_kv_cache,
                                 write_kv_cache_reference)
from kvscope.kernels.mla_decode import mla_decode_attention, mla_decode_attention_reference
from kvscope.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from kvscope.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference

FEW = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Output tolerance: the kernels accumulate in fp32 like the reference; what differs is summation
# order and the final rounding to the query's dtype.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
HEAD_RATIOS = [(2, 2), (8, 2), (16, 2), (4, 1)]  # (query heads, KV heads): 1, 4, 8, MQA


# ---- building paged caches ------------------------------------------------------------------------


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, Dv]
    k_scale: torch.Tensor | None  # int8 only: [num_blocks, block_size, Hkv]
    v_scale: torch.Tensor | None
    tables: torch.Tensor  # [S, W] int32, padded with a block nobody owns
    lens: torch.Tensor  # [S] int32


def make_paged(lens: list[int], block_size: int, hkv: int, d: int, dv: int, kv: str, seed: int) -> Paged:
    """Sequences of the given context lengths in scattered blocks; every unowned slot is NaN."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare, order = order[0], order[1:]  # a block nobody owns pads the tables
    width = max(need) + 1
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables = []
    for n, k in zip(lens, need):
        blocks, order = order[:k], order[k:]
        for pos in range(n):
            owned[blocks[pos // block_size], pos % block_size] = True
        tables.append(blocks + [spare] * (width - k))
    k_cache, k_scale = _fill(num_blocks, block_size, hkv, d, kv, owned, gen)
    v_cache, v_scale = _fill(num_blocks, block_size, hkv, dv, kv, owned, gen)
    return Paged(k_cache, v_cache, k_scale, v_scale, torch.tensor(tables, dtype=torch.int32),
                 torch.tensor(lens, dtype=torch.int32))


def _fill(num_blocks, block_size, heads, dim, kv, owned, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    if kv == "int8":
        q, scale = quantize_int8_reference(x)
        return q, scale.masked_fill(~owned[..., None], float("nan"))
    return x.masked_fill(~owned[..., None, None], float("nan")).to(DTYPES[kv]), None


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[out.dtype], rtol=TOL[out.dtype])


# ---- strategies -----------------------------------------------------------------------------------


@st.composite
def contexts(draw, block_size: int, max_seqs: int = 3) -> list[int]:
    """Ragged context lengths, often 1 or an exact multiple of the block size."""
    one = st.one_of(st.integers(1, 48), st.just(1), st.integers(1, 3).map(lambda m: m * block_size))
    return draw(st.lists(one, min_size=1, max_size=max_seqs))


@st.composite
def attention_cases(draw) -> dict:
    block_size = draw(st.integers(1, 32))
    hq, hkv = draw(st.sampled_from(HEAD_RATIOS))
    kv = draw(st.sampled_from(["fp32", "fp16", "bf16", "int8"]))
    q_dtype = draw(st.sampled_from(["fp32", "fp16"])) if kv == "int8" else kv
    return dict(block_size=block_size, hq=hq, hkv=hkv, d=draw(st.sampled_from([16, 24, 32])), kv=kv,
                q_dtype=DTYPES[q_dtype], lens=draw(contexts(block_size)), tile=draw(st.sampled_from([16, 32])),
                seed=draw(st.integers(0, 2**16)))


def queries(rows: int, heads: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)


# ---- write_kv_cache -------------------------------------------------------------------------------


@FEW
@given(block_size=st.integers(1, 32), heads=st.integers(1, 3), d=st.sampled_from([8, 16, 24]),
       cache=st.sampled_from(["fp32", "fp16", "bf16", "int8"]), source=st.sampled_from(list(DTYPES)),
       mla=st.booleans(), data=st.data())
def test_write_kv_cache_matches_reference_exactly(block_size, heads, d, cache, source, mla, data):
    """Rows land in their slots bit for bit; int8 rows with exactly the reference's codes and scales.

    A float cache is written from rows of its own dtype, as in the engine: the interpreter rounds
    fp32 -> bf16 toward zero where a GPU rounds to nearest even, so a converting store is not exact.
    """
    num_slots = 3 * block_size + 5
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=20, unique=True))
    slots = [s if data.draw(st.integers(0, 5)) else -1 for s in slots]  # -1: padding, written nowhere
    n, heads = len(slots), 1 if mla else heads
    dtype = torch.int8 if cache == "int8" else DTYPES[cache]
    source = DTYPES[source] if cache == "int8" else dtype
    k, v = (torch.randn(n, heads, d) * 3).to(source), torch.randn(n, heads, d).to(source)
    shape = (-(-num_slots // block_size), block_size, heads, d)
    got = [torch.zeros(shape, dtype=dtype), None if mla else torch.zeros(shape, dtype=dtype)]
    want = [c if c is None else c.clone() for c in got]
    scales = [torch.zeros(shape[:3]) if cache == "int8" else None for _ in range(4)]
    slot_mapping = torch.tensor(slots)
    write_kv_cache(k, v, got[0], got[1], slot_mapping, scales[0], scales[1])
    write_kv_cache_reference(k, v, want[0], want[1], slot_mapping, scales[2], scales[3])
    for a, b in zip(got + scales[:2], want + scales[2:]):
        assert a is None or torch.equal(a, b)


def test_int8_rows_round_trip_within_half_a_step():
    x = torch.randn(64, 4, 32) * torch.rand(64, 4, 1) * 10  # rows of very different magnitudes
    q, scale = quantize_int8_reference(x)
    err = (dequantize_int8_reference(q, scale) - x).abs()
    assert (err <= scale[..., None] / 2 + 1e-6).all()
    assert torch.equal(q.abs().amax(-1), torch.full((64, 4), 127, dtype=torch.int8))


# ---- paged_decode_attention -----------------------------------------------------------------------


@FEW
@given(case=attention_cases(), splits=st.sampled_from([None, 1, 2, 3]))
def test_paged_decode_matches_reference(case, splits):
    c = case
    paged = make_paged(c["lens"], c["block_size"], c["hkv"], c["d"], c["d"], c["kv"], c["seed"])
    q = queries(len(c["lens"]), c["hq"], c["d"], c["q_dtype"], c["seed"])
    args = (q, paged.k_cache, paged.v_cache, paged.tables, paged.lens, c["d"] ** -0.5, paged.k_scale, paged.v_scale)
    out = paged_decode_attention(*args, num_splits=splits, tile=c["tile"])
    assert_close(out, paged_decode_attention_reference(*args))


def test_decode_split_k_gives_the_single_pass_result():
    """Flash-decoding: 5 splits of a 70-token context, combined by log-sum-exp, equal one pass."""
    paged = make_paged([70, 3, 16], 16, 2, 16, 16, "fp32", seed=7)
    q = queries(3, 8, 16, torch.float32, seed=7)
    args = (q, paged.k_cache, paged.v_cache, paged.tables, paged.lens, 0.25)
    one = paged_decode_attention(*args, num_splits=1, tile=16)
    five = paged_decode_attention(*args, num_splits=5, tile=16)
    torch.testing.assert_close(five, one, atol=1e-6, rtol=1e-6)
    assert_close(five, paged_decode_attention_reference(*args))


def test_decode_on_int8_cache_is_close_to_full_precision():
    """Quantizing K/V per token and head moves the attention output by well under 1%."""
    paged = make_paged([40, 9], 8, 2, 32, 32, "fp32", seed=3)
    q = queries(2, 8, 32, torch.float32, seed=3)
    full = paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.tables, paged.lens, 32**-0.5, tile=16)
    k8, ks = quantize_int8_reference(paged.k_cache.nan_to_num())
    v8, vs = quantize_int8_reference(paged.v_cache.nan_to_num())
    quant = paged_decode_attention(q, k8, v8, paged.tables, paged.lens, 32**-0.5, ks, vs, tile=16)
    assert (quant - full).abs().max() < 0.01 * full.abs().max()


# ---- paged_prefill_attention ----------------------------------------------------------------------


@FEW
@given(case=attention_cases(), data=st.data())
def test_paged_prefill_matches_reference(case, data):
    """Each sequence's last q_len tokens are its chunk: a whole prompt, a later chunk, or k+1 rows."""
    c = case
    q_lens = [data.draw(st.one_of(st.just(n), st.integers(1, min(n, 5)), st.integers(1, n))) for n in c["lens"]]
    paged = make_paged(c["lens"], c["block_size"], c["hkv"], c["d"], c["d"], c["kv"], c["seed"])
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = queries(sum(q_lens), c["hq"], c["d"], c["q_dtype"], c["seed"])
    args = (q, paged.k_cache, paged.v_cache, paged.tables, starts, paged.lens, c["d"] ** -0.5,
            paged.k_scale, paged.v_scale)
    block_m = data.draw(st.sampled_from([None, 16, 32]))
    out = paged_prefill_attention(*args, block_m=block_m, tile=c["tile"])
    assert_close(out, paged_prefill_attention_reference(*args))


def test_prefill_serves_speculative_verification():
    """k + 1 = 5 query rows at the end of a 37-token context: row i sees keys 0..32 + i."""
    paged = make_paged([37], 4, 2, 16, 16, "fp32", seed=11)
    q = queries(5, 8, 16, torch.float32, seed=11)
    starts = torch.tensor([0, 5], dtype=torch.int32)
    out = paged_prefill_attention(q, paged.k_cache, paged.v_cache, paged.tables, starts, paged.lens, 0.25, tile=16)
    for i in range(5):  # each row equals a decode over the first 33 + i tokens
        row = paged_decode_attention(q[i : i + 1], paged.k_cache, paged.v_cache, paged.tables,
                                     torch.tensor([33 + i], dtype=torch.int32), 0.25, tile=16)
        torch.testing.assert_close(out[i], row[0], atol=1e-6, rtol=1e-6)


# ---- mla_decode_attention -------------------------------------------------------------------------


@FEW
@given(block_size=st.integers(1, 32), heads=st.sampled_from([4, 16, 20]), rank=st.sampled_from([16, 32]),
       rope=st.sampled_from([8, 16]), dtype=st.sampled_from(list(DTYPES)), splits=st.sampled_from([None, 2]),
       seed=st.integers(0, 2**16), data=st.data())
def test_mla_decode_matches_reference(block_size, heads, rank, rope, dtype, splits, seed, data):
    lens = data.draw(contexts(block_size))
    paged = make_paged(lens, block_size, 1, rank + rope, 1, dtype, seed)  # one plane: its v_cache goes unused
    q = queries(len(lens), heads, rank + rope, DTYPES[dtype], seed)
    args = (q, paged.k_cache, paged.tables, paged.lens, rank, (rank + rope) ** -0.5)
    out = mla_decode_attention(*args, num_splits=splits, tile=16)
    assert_close(out, mla_decode_attention_reference(*args))
