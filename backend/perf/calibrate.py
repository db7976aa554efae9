"""`this-machine`: a profile measured by a micro-benchmark of a few seconds, then kept in the cache dir.

Two numbers make a roofline: matmul FLOP/s and memory bandwidth. Both are measured on the device
kvscope would run on (CUDA when present, else the CPU) with plain torch: a square fp32 matmul (and
bf16 on CUDA, the tensor-core roof), and a copy of a tensor far larger than any cache, counting
read plus write (sizes per device in SIZES). Two more make it an empirical roofline: the share of
that bandwidth a linear layer reaches while streaming weights that no cache holds, over one token
(a GEMV) and over four (a GEMM). On a CPU they differ: its BLAS packs the weights before a GEMM
(on the 2-core development VM: 19 and 11 GB/s against a 40 GB/s copy). The best repetition is
kept, not the mean: a roof is what the machine can reach. The result is saved as JSON
(machine_cache.py) and reused on the same host; `this_machine(recalibrate=True)` measures again.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone

import torch

from kvscope.backend.perf.machine_cache import CACHE_VERSION, read_cache, write_cache

# (matmul side, fp32 copy elements, weight matrices of 1024² fp32) per device type. CPU: 256 MB
# outgrows the caches of most CPUs (64 MB did not always), so the copy streams from DRAM, and so do
# 256 MB of weights. CUDA: a 1024² matmul or a 64 MB copy takes microseconds, less than the
# synchronize that times it, so a GPU gets work of milliseconds (a 1 GB copy and 1 GB of weights,
# an 8192² matmul).
SIZES = {"cpu": (1024, 64 * 1024**2, 64), "cuda": (8192, 256 * 1024**2, 256)}
GEMM_ROWS = 4  # tokens of the "several tokens" weight stream: a small decode batch
DEFAULT_SECONDS = 4.0  # total budget; the brief of this feature allows 5 s


def this_machine(recalibrate: bool = False) -> dict:
    """The cached figures of this host, or a fresh measurement (saved for next time)."""
    cached = None if recalibrate else read_cache()
    if cached is not None:
        return cached
    figures = calibrate()
    try:
        write_cache(figures)
    except OSError:
        pass  # the cache only saves seconds; a read-only home must not stop a what-if
    return figures


def calibrate(seconds: float = DEFAULT_SECONDS, device: str | None = None) -> dict:
    """Measure matmul FLOP/s, copy bandwidth and the weight streams within about `seconds`; a JSON-ready dict."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    share = seconds / 5
    fp32 = measure_matmul_flops(dev, torch.float32, share)
    # On a CPU, kvscope computes in fp32 (bf16 has no fast path on most CPUs): one roof for both.
    bf16 = measure_matmul_flops(dev, torch.bfloat16, share) if dev.type == "cuda" else fp32
    bandwidth = measure_copy_bandwidth(dev, share)
    gemv, gemm = (measure_weight_stream(dev, rows, share) for rows in (1, GEMM_ROWS))
    return {"version": CACHE_VERSION, "host": platform.node(), "device": describe(dev),
            "fp32_flops": fp32, "bf16_flops": bf16, "mem_bandwidth": bandwidth,
            # A kernel can beat a copy's rate (a pure read stream), but the roof is the memory's: cap at 1.
            "gemv_efficiency": min(gemv / bandwidth, 1.0), "gemm_efficiency": min(gemm / bandwidth, 1.0),
            "memory_bytes": memory_bytes(dev), "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def best_seconds(run, budget_s: float, sync) -> float:
    """Fastest of as many repetitions of run() as fit in budget_s (at least three)."""
    run()
    sync()  # warm-up: allocation, thread pool, cuBLAS handle
    best, deadline, reps = float("inf"), time.perf_counter() + budget_s, 0
    while reps < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        sync()
        best, reps = min(best, time.perf_counter() - start), reps + 1
    return best


def measure_matmul_flops(dev: torch.device, dtype: torch.dtype, budget_s: float) -> float:
    n = SIZES[dev.type][0]
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=out), budget_s, synchronizer(dev))


def measure_copy_bandwidth(dev: torch.device, budget_s: float) -> float:
    src = torch.ones(SIZES[dev.type][1], device=dev)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()  # read the source, write the destination
    return moved / best_seconds(lambda: dst.copy_(src), budget_s, synchronizer(dev))


def measure_weight_stream(dev: torch.device, rows: int, budget_s: float) -> float:
    """Weight bytes/s of linear layers over `rows` tokens, the weights too many for any cache to hold."""
    weights = [torch.ones(1024, 1024, device=dev) for _ in range(SIZES[dev.type][2])]
    x = torch.ones(rows, 1024, device=dev)
    moved = sum(w.numel() * w.element_size() for w in weights)
    return moved / best_seconds(lambda: [torch.nn.functional.linear(x, w) for w in weights], budget_s,
                                synchronizer(dev))


def synchronizer(dev: torch.device):
    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def describe(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def memory_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
