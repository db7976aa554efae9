"""Two ways to run a GGUF Q8_0 matrix on torch's CPU kernels, timed on SmolLM2's shapes at one token.

    OMP_NUM_THREADS=2 python -m bench.q8_routes [--reps N] [--json OUT.json]

Q8_0 stores `w = d · q` per block of 32 weights, q an int8 in [-127, 127]. torch's CPU kernels take no
such groups for int8 (`_weight_int8pack_mm` takes one scale per row), so kvscope re-quantizes each row
(backend/model/gguf_weights.py). The exact alternative splits every code into two 4-bit planes,
`q = 16·h + l` with h in [-8, 7] and l in [0, 15], and runs both through the int4 kernel
(`_weight_int4pack_mm_for_cpu`, groups of 32, which computes `(u - 8)·scale + zero` of a stored u in
0..15) as one matrix of twice the rows: the high plane stores h + 8 with scale 16·d and zero 8·d
(16·d·h + 8·d), the low plane stores l with scale d and zero 0 (l·d - 8·d); the halves, added in
float32, give d·q, and each half stays near the output's size (the 8·d moved into the high plane's zero
keeps the low one centred). Its weights are the file's exactly (the scales rounded to bfloat16, as for
Q4). Columns: each route's time per call (median of `--reps`, after warm-up), the bytes it reads and
their rate, and its output's largest error against the exact Q8_0 product, relative to the output's
largest value.

A second table takes the int8 rows at more rows of activations (a prefill chunk, a wide decode batch):
torch's int8 kernel, a GEMV per row, against `int8_tiles_matmul` (backend/model/quant.py: bfloat16 tiles
of the codes, one GEMM each for all rows), which the engine runs from `GEMM_ROWS` rows up; the error
is each one's against the same int8 rows' exact product.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvscope.backend.model.quant import GEMM_ROWS, int8_tiles_matmul

GROUP = 32
SHAPES = {"q, k, v joined": (960, 576), "o_proj": (576, 576), "gate, up joined": (3072, 576), "down_proj": (576, 1536),
          "lm_head (49,152 rows)": (49152, 576)}  # (out N, in K)
ROWS = (1, 8, 16, 32, 128)  # rows of activations for the second table


def q8_0_blocks(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 blocks: codes int32 [N, K] in [-127, 127] and bfloat16-exact scales float32 [N, K / 32]."""
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16).float()
    return codes, scales


def int8_rows(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's route: the blocks de-quantized and quantized again with one bfloat16 scale per row."""
    n, k = codes.shape
    w = (codes.view(n, -1, GROUP).float() * scales[..., None]).view(n, k)
    row = (w.abs().amax(1) / 127).to(torch.bfloat16)
    return torch.round(w / row.float()[:, None]).clamp(-127, 127).to(torch.int8), row


def int4_planes(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact route: [2N, K] 4-bit planes packed for the int4 kernel, scales and zeros [K / 32, 2N, 2]."""
    high, low = codes >> 4, codes & 15  # q = 16·high + low
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat([high + 8, low], 0), 1)
    scale = torch.cat([16 * scales, scales], 0)  # [2N, K / 32]
    zero = torch.cat([8 * scales, torch.zeros_like(scales)], 0)  # high: 16·d·h + 8·d; low: l·d - 8·d
    return packed, torch.stack([scale.T, zero.T], -1).to(torch.bfloat16).contiguous()


def median_us(fn, reps: int) -> float:
    for _ in range(max(reps // 10, 3)):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of y against the exact product, relative to the product's largest value."""
    return ((y.double() - exact).abs().max() / exact.abs().max()).item()


def measure(name: str, n: int, k: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    codes, scales = q8_0_blocks(n, k, gen)
    x = torch.randn(1, k, generator=gen)
    exact = x.double() @ (codes.view(n, -1, GROUP).double() * scales.double()[..., None]).view(n, k).T
    rows, row_scales = int8_rows(codes, scales)
    packed, scales_zeros = int4_planes(codes, scales)
    xb = x.to(torch.bfloat16)

    def by_rows() -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(xb, rows, row_scales)

    def by_planes() -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scales_zeros)  # [1, 2N]
        return y[:, :n].float() + y[:, n:].float()

    bytes_rows = rows.nbytes + row_scales.nbytes
    bytes_planes = packed.nbytes + scales_zeros.nbytes
    rows_us, planes_us = median_us(by_rows, reps), median_us(by_planes, reps)
    return {"layer": name, "n": n, "k": k, "rows_us": rows_us, "planes_us": planes_us,
            "rows_gb_s": bytes_rows / rows_us / 1e3, "planes_gb_s": bytes_planes / planes_us / 1e3,
            "rows_error": relative_error(by_rows(), exact), "planes_error": relative_error(by_planes(), exact)}


def measure_rows(name: str, n: int, k: int, m: int, reps: int) -> dict:
    """The int8 rows at m rows of activations: torch's kernel against bfloat16 tiles."""
    gen = torch.Generator().manual_seed(0)
    rows, row_scales = int8_rows(*q8_0_blocks(n, k, gen))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    exact = x.double() @ (rows.double() * row_scales.double()[:, None]).T

    def kernel() -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, rows, row_scales)

    def tiles() -> torch.Tensor:
        return int8_tiles_matmul(x, rows, row_scales)

    return {"layer": name, "n": n, "k": k, "m": m,
            "kernel_us": median_us(kernel, reps), "tiles_us": median_us(tiles, reps),
            "kernel_error": relative_error(kernel(), exact), "tiles_error": relative_error(tiles(), exact)}


def main(argv: list[str] | None = None) -> int:
    from bench.report import command_line, table

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.q8_routes", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=200, help="timed calls per route and layer")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    results = [measure(name, n, k, args.reps) for name, (n, k) in SHAPES.items()]
    print(f"# {command_line('bench.q8_routes', argv)}\n\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          "one token (bfloat16 activations)\n")
    print(table(["layer [N x K]", "int8 rows µs", "two int4 planes µs", "planes ÷ rows", "rows GB/s", "planes GB/s",
                 "error, int8 rows", "error, planes (exact weights)"],
                [[f"{r['layer']} [{r['n']} x {r['k']}]", f"{r['rows_us']:.1f}", f"{r['planes_us']:.1f}",
                  f"{r['planes_us'] / r['rows_us']:.2f}x", f"{r['rows_gb_s']:.1f}", f"{r['planes_gb_s']:.1f}",
                  f"{r['rows_error']:.1e}", f"{r['planes_error']:.1e}"] for r in results]))
    by_rows = [measure_rows(name, n, k, m, max(args.reps // 10, 5)) for name, (n, k) in SHAPES.items() for m in ROWS]
    print(f"\nThe int8 rows by rows of activations (`GEMM_ROWS` = {GEMM_ROWS}: the engine's switch to tiles)\n")
    print(table(["layer [N x K]", "rows of x", "int8 kernel µs", "bfloat16 tiles µs", "tiles ÷ kernel",
                 "error, kernel", "error, tiles"],
                [[f"{r['layer']} [{r['n']} x {r['k']}]", str(r["m"]), f"{r['kernel_us']:.1f}", f"{r['tiles_us']:.1f}",
                  f"{r['tiles_us'] / r['kernel_us']:.2f}x", f"{r['kernel_error']:.1e}", f"{r['tiles_error']:.1e}"]
                 for r in by_rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one_token": results, "by_rows": by_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
