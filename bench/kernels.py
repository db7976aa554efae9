"""Kernel benchmark: paged_decode_attention against the memory roofline and against dense baselines.

    python -m bench.kernels [--json OUT.json] [--peak-gbps N] [--batches 1,16,64] [--contexts 512,4096,32768]

Decode reads the whole K/V of every sequence to produce one token each: it is memory-bound, so the
figure that matters is achieved bandwidth, bytes moved (K and V read, Q read, O written) over time,
as a share of the device's peak (a table by device name, or --peak-gbps). Against:
- torch SDPA on the same K/V already gathered into contiguous [B, Hkv, ctx, D] tensors (the gather
  is not timed: this is the dense ideal a paged kernel has to match despite its block-table
  indirection);
- flash_attn's flash_attn_with_kvcache on contiguous [B, ctx, Hkv, D] caches, when flash_attn is
  installed (its paged mode wants pages of 256 tokens, so it is given the dense layout too);
- itself without split-K (num_splits=1), to show what flash-decoding buys at small batches;
- itself on an int8 cache: half the bytes.
Shapes: 32 query / 8 KV heads, head_dim 128, bf16, block size 16, blocks scattered at random.

Without CUDA the GPU figures cannot be measured: the script says so and exits 0.
`--interpret-smoke` instead runs one tiny case through the same code on the CPU under
TRITON_INTERPRET=1, to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass

PEAK_GBPS = {  # HBM/GDDR peak by device name substring, first match wins: most specific first
    "GH200": 4000, "H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
    "B200": 8000, "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L40": 864,
    "L4": 300, "A10G": 600, "A10": 600, "RTX 4090": 1008, "RTX 3090": 936, "V100": 900, "T4": 320,
}
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    q_heads: int = Q_HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE

    def bytes_moved(self, kv_bytes: int = 2, act_bytes: int = 2) -> int:
        """K and V read once per KV head; Q read and O written once per query head."""
        kv = 2 * self.batch * self.context * self.kv_heads * self.head_dim * kv_bytes
        scales = 2 * self.batch * self.context * self.kv_heads * 4 if kv_bytes == 1 else 0
        return kv + scales + 2 * self.batch * self.q_heads * self.head_dim * act_bytes


@dataclass
class Row:
    batch: int
    context: int
    num_splits: int
    kernel_us: float
    gbps: float
    pct_of_peak: float | None
    no_split_us: float
    int8_us: float | None
    sdpa_us: float | None
    flash_us: float | None
    max_abs_err: float  # against SDPA's output


# ---- inputs ---------------------------------------------------------------------------------------


def make_inputs(shape: Shape, device, dtype, seed: int = 0) -> dict:
    """A paged cache whose blocks are scattered at random, and the same K/V gathered contiguously."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = math.ceil(shape.context / shape.block_size)
    num_blocks = shape.batch * per_seq
    kv_shape = (num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    tables = order.view(shape.batch, per_seq).to(torch.int32)
    lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=lens)


def gathered(cache, tables, context: int):
    """[num_blocks, block_size, Hkv, D] through tables [B, W] -> contiguous [B, ctx, Hkv, D]."""
    return cache[tables.long()].flatten(1, 2)[:, :context].contiguous()


# ---- the contestants ------------------------------------------------------------------------------


def kernel_fn(x: dict, shape: Shape, num_splits: int | None = None, int8: dict | None = None):
    from kvscope.kernels.paged_decode import paged_decode_attention

    k, v, ks, vs = (int8["k"], int8["v"], int8["ks"], int8["vs"]) if int8 else (x["k_cache"], x["v_cache"], None, None)
    return lambda: paged_decode_attention(x["q"], k, v, x["tables"], x["lens"], shape.head_dim**-0.5, ks, vs,
                                          max_context_len=shape.context, num_splits=num_splits)


def sdpa_fn(x: dict, k, v, shape: Shape):
    import torch.nn.functional as F

    q = x["q"].unsqueeze(2)  # [B, Hq, 1, D]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, ctx, D]
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=shape.head_dim**-0.5, enable_gqa=True).squeeze(2)


def flash_fn(x: dict, k, v, shape: Shape):
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    q = x["q"].unsqueeze(1)  # [B, 1, Hq, D]
    return lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=x["lens"], softmax_scale=shape.head_dim**-0.5)


def quantized(x: dict, chunk: int = 4096) -> dict:
    """int8 copies of the caches with their scales, a few thousand blocks at a time (fp32 temporaries)."""
    import torch

    from kvscope.kernels.cache_write import quantize_int8_reference

    out = {}
    for name, cache in (("k", x["k_cache"]), ("v", x["v_cache"])):
        parts = [quantize_int8_reference(cache[i : i + chunk]) for i in range(0, cache.shape[0], chunk)]
        out[name], out[name + "s"] = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return out


# ---- timing ---------------------------------------------------------------------------------------


def time_us(fn, cuda: bool) -> float:
    """Median microseconds per call: CUDA events via triton's do_bench, or wall time on the CPU."""
    if cuda:
        from triton.testing import do_bench

        return 1000 * do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[1]


def measure(shape: Shape, device, dtype, cuda: bool, peak_gbps: float | None) -> Row:
    from kvscope.kernels.paged_decode import plan_splits

    x = make_inputs(shape, device, dtype)
    k, v = gathered(x["k_cache"], x["tables"], shape.context), gathered(x["v_cache"], x["tables"], shape.context)
    sdpa, flash = sdpa_fn(x, k, v, shape), flash_fn(x, k, v, shape)
    err = (kernel_fn(x, shape)().float() - sdpa().float()).abs().max().item()
    us = time_us(kernel_fn(x, shape), cuda)
    gbps = shape.bytes_moved() / us / 1e3
    int8_us = time_us(kernel_fn(x, shape, int8=quantized(x)), cuda)
    splits, _ = plan_splits(shape.batch, shape.kv_heads, shape.context, 64, device)
    return Row(shape.batch, shape.context, splits, us, gbps, 100 * gbps / peak_gbps if peak_gbps else None,
               time_us(kernel_fn(x, shape, num_splits=1), cuda), int8_us, time_us(sdpa, cuda),
               time_us(flash, cuda) if flash else None, err)


def run_grid(batches, contexts, device, dtype, cuda: bool, peak_gbps: float | None) -> list[Row]:
    import torch

    rows = []
    for batch in batches:
        for context in contexts:
            print(f"  batch {batch}, context {context} ...", file=sys.stderr, flush=True)
            try:
                rows.append(measure(Shape(batch, context), device, dtype, cuda, peak_gbps))
            except torch.cuda.OutOfMemoryError:
                print(f"  batch {batch}, context {context}: out of memory, skipped", file=sys.stderr)
            if cuda:
                torch.cuda.empty_cache()
    return rows


# ---- output ---------------------------------------------------------------------------------------


def peak_for(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def fmt(x: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "—" if x is None else format(x, spec) + unit


def print_table(rows: list[Row]) -> None:
    print("| batch | context | splits | kernel µs | GB/s | % of peak | no split-K µs | int8 KV µs | "
          "SDPA µs | vs SDPA | flash_attn µs | vs flash_attn | max err |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        vs_sdpa = r.sdpa_us / r.kernel_us if r.sdpa_us else None
        vs_flash = r.flash_us / r.kernel_us if r.flash_us else None
        print(f"| {r.batch} | {r.context} | {r.num_splits} | {r.kernel_us:.1f} | {r.gbps:.0f} | {fmt(r.pct_of_peak)} "
              f"| {r.no_split_us:.1f} | {fmt(r.int8_us)} | {fmt(r.sdpa_us)} | {fmt(vs_sdpa, '.2f', 'x')} "
              f"| {fmt(r.flash_us)} | {fmt(vs_flash, '.2f', 'x')} | {r.max_abs_err:.1e} |")
    print("\n`vs X` = X's time / the kernel's time (above 1: the kernel is faster).")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth (default: by device name)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="512,4096,32768")
    p.add_argument("--interpret-smoke", action="store_true", help="one tiny case on the CPU interpreter")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    meta = {"command": "python -m bench.kernels " + shlex.join(argv), "torch": torch.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    cuda = torch.cuda.is_available() and not args.interpret_smoke
    if not cuda and not args.interpret_smoke:
        print("bench.kernels: no CUDA device here; the GPU figures (bandwidth, time against SDPA and "
              "flash_attn) need a GPU. Nothing measured.")
        write_json(args.json, meta | {"cuda": False, "rows": []})
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    peak = args.peak_gbps or (peak_for(name) if cuda else None)
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    if args.interpret_smoke:
        batches, contexts = [2], [40]
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 dot is unsound
    meta |= {"device": name, "peak_gbps": peak, "cuda": cuda, "dtype": str(dtype).removeprefix("torch."),
             "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE}
    print(f"# paged_decode_attention on {name} (peak {fmt(peak, '.0f')} GB/s), {meta['dtype']}, "
          f"{Q_HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, block size {BLOCK_SIZE}\n")
    rows = run_grid(batches, contexts, device, dtype, cuda, peak)
    print_table(rows)
    write_json(args.json, meta | {"rows": [asdict(r) for r in rows]})
    return 0


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
