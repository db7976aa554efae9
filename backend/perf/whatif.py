"""`kvscope whatif`: one iteration of a model shape on a GPU type, costed op group by op group.

A decode step of B sequences at context T, or (--prefill) B prompts of T tokens each, through the
roofline model of cost_model.py. Output: a table, or with --json one object whose `flops`, `bytes`,
`time_s` and `bound` describe the iteration on one GPU, and its three limits: `compute_s` (every
FLOP at the compute roof), `memory_s` (every byte at the bandwidth roof) and `fixed_s`, the step's
fixed cost (dispatch, launches, Python): the profile's overhead, or `--fixed-ms`, e.g. the figure a
run's roofline measured on this machine, eager or compiled. `limit` names the one that dominates.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvscope.backend.config import kv_storage_dtype
from kvscope.backend.perf.cost_model import BatchItem, Deployment, IterationCost, iteration_cost, resident_bytes
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.hardware import LINKS, HardwareProfile, get_hardware
from kvscope.backend.perf.shapes import ModelShape, get_shape

DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def kv_text(kv_cache_dtype: str, dtype: str) -> str:
    """What a what-if's KV cache stores, as its tables name it: "fp16", "int8"."""
    kv = kv_storage_dtype(kv_cache_dtype, dtype)
    return DTYPE_SHORT.get(kv, kv)


def deployment(model_shape: str | ModelShape, hardware: str | HardwareProfile, tp: int = 1,
               kv_cache_dtype: str = "auto", weight_quant: str = "none", quant_group_size: int = 64,
               link: str | None = None) -> Deployment:
    """Resolve names (unknown ones raise a PerfError listing the valid names) into a Deployment."""
    shape = get_shape(model_shape) if isinstance(model_shape, str) else model_shape
    hw = get_hardware(hardware, link, max(tp, 2)) if isinstance(hardware, str) else hardware
    return Deployment(shape, hw, tp, kv_cache_dtype, weight_quant, quant_group_size)


def step_batch(batch: int, context: int, prefill: bool = False) -> list[BatchItem]:
    """B decode rows at context T, or B whole prompts of T tokens (each samples its last token)."""
    if batch < 1:
        raise PerfError("batch", f"must be >= 1, got {batch}")
    if context < 1:
        raise PerfError("context", f"must be >= 1, got {context}")
    row = BatchItem("prefill", context, context) if prefill else BatchItem("decode", 1, context)
    return [row] * batch


def whatif(model_shape: str | ModelShape, hardware: str | HardwareProfile, batch: int, context: int,
           prefill: bool = False, tp: int = 1, kv_cache_dtype: str = "auto", weight_quant: str = "none",
           quant_group_size: int = 64, link: str | None = None, fixed_s: float | None = None) -> dict:
    """One iteration's FLOPs, bytes, intensity, bound and time, in total and by op group (per GPU).
    fixed_s: the step's fixed cost in place of the profile's overheads."""
    dep = deployment(model_shape, hardware, tp, kv_cache_dtype, weight_quant, quant_group_size, link)
    if fixed_s is not None:
        if not math.isfinite(fixed_s) or fixed_s < 0:
            raise PerfError("fixed_ms", f"must be a finite number >= 0, got {fixed_s * 1e3}")
        dep = replace(dep, hardware=replace(dep.hardware, iteration_overhead_s=fixed_s, row_overhead_s=0.0,
                                            token_overhead_s=0.0))
    cost = iteration_cost(dep, step_batch(batch, context, prefill))
    return describe(dep, cost, batch, context, prefill)


def describe(dep: Deployment, cost: IterationCost, batch: int, context: int, prefill: bool) -> dict:
    """The JSON form of a what-if."""
    weights, kv = resident_bytes(dep), batch * context * dep.kv_bytes_per_token
    return {
        "model_shape": dep.shape.name, "hardware": dep.hardware.name, "hardware_label": dep.hardware.label,
        "link": dep.hardware.link.name if dep.hardware.link else None,
        "tp": dep.tp, "phase": "prefill" if prefill else "decode", "batch": batch, "context": context,
        "dtype": dep.dtype, "weight_quant": dep.weight_quant, "kv_cache_dtype": dep.kv_cache_dtype,
        "flops": cost.flops, "bytes": cost.bytes, "time_s": cost.time_s, "intensity": cost.intensity,
        "ridge": cost.ridge, "bound": cost.bound, "overhead_s": cost.overhead_s,
        "compute_s": cost.compute_s, "memory_s": cost.memory_s, "roof_s": cost.roof_s, "fixed_s": cost.overhead_s,
        "limit": "fixed cost" if cost.overhead_s > cost.roof_s else cost.bound,
        "mem_bandwidth": dep.hardware.mem_bandwidth,
        "weight_stream": {"one_token": dep.hardware.weight_bandwidth(1),
                          "several_tokens": dep.hardware.weight_bandwidth(2)},
        "tokens": cost.num_tokens, "tokens_per_s": cost.num_tokens / cost.time_s,
        "ops": [{"group": op.group, "flops": op.flops, "bytes": op.bytes, "link_bytes": op.link_bytes,
                 "intensity": op.intensity if op.bytes else None, "bound": op.bound, "time_s": op.time_s}
                for op in cost.ops],
        "memory": {"weights_bytes": weights, "kv_bytes": kv, "capacity_bytes": dep.hardware.memory_bytes,
                   "fits": weights + kv <= dep.hardware.memory_bytes},
        "per_gpu": True,
    }


def decode_knee(dep: Deployment, context: int, max_batch: int = 1024) -> int | None:
    """Smallest decode batch (up to max_batch) whose iteration is compute-bound, or None.

    Intensity grows with the batch (weights are shared, per-row work is not), so the bound flips
    at most once and a bisection finds it.
    """
    def compute_bound(b: int) -> bool:
        return iteration_cost(dep, step_batch(b, context)).bound == "compute"

    if not compute_bound(max_batch):
        return None
    lo, hi = 1, max_batch  # invariant: hi is compute-bound
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid + 1, hi)
    return hi


# ---- the table ----------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    """The what-if as a plain-text table: one line per op group, then the iteration."""
    r = result
    rows = "prompt" if r["phase"] == "prefill" else "sequence"
    what = (f"prefill of {r['batch']:,} {rows}{'s' * (r['batch'] != 1)} of {r['context']:,} tokens"
            if r["phase"] == "prefill" else
            f"decode step of {r['batch']:,} {rows}{'s' * (r['batch'] != 1)} at context {r['context']:,}")
    weights = r["weight_quant"] if r["weight_quant"] != "none" else DTYPE_SHORT.get(r["dtype"], r["dtype"])
    kv = kv_text(r["kv_cache_dtype"], r["dtype"])
    tp = f", tp {r['tp']} over {r['link']}" if r["tp"] > 1 else ""
    lines = [f"{r['model_shape']} on {r['hardware_label']}{tp}: {what} ({weights} weights, {kv} KV)",
             f"{'op group':<12}{'GFLOP':>12}{'MB':>12}{'FLOP/B':>10}  {'bound':<8}{'ms':>10}"]
    for op in r["ops"]:
        moved = op["bytes"] or op["link_bytes"]
        intensity = f"{op['intensity']:,.1f}" if op["intensity"] is not None else "-"
        lines.append(f"{op['group']:<12}{op['flops'] / 1e9:>12,.2f}{moved / 1e6:>12,.1f}{intensity:>10}  "
                     f"{op['bound']:<8}{op['time_s'] * 1e3:>10.3f}")
    lines.append(f"{'fixed cost':<12}{'':>44}{r['fixed_s'] * 1e3:>10.3f}")
    lines.append(f"{'iteration':<12}{r['flops'] / 1e9:>12,.2f}{r['bytes'] / 1e6:>12,.1f}{r['intensity']:>10,.1f}  "
                 f"{r['bound']:<8}{r['time_s'] * 1e3:>10.3f}")
    lines.append(f"three limits: compute {r['compute_s'] * 1e3:,.3g} ms, memory {r['memory_s'] * 1e3:,.3g} ms, "
                 f"fixed cost {r['fixed_s'] * 1e3:,.3g} ms: {r['limit']} dominates")
    stream = r["weight_stream"]
    if stream["one_token"] < r["mem_bandwidth"] or stream["several_tokens"] < r["mem_bandwidth"]:
        lines.append(f"weights stream at {stream['one_token'] / 1e9:,.1f} GB/s over one token, "
                     f"{stream['several_tokens'] / 1e9:,.1f} over several (measured; the roof is "
                     f"{r['mem_bandwidth'] / 1e9:,.1f} GB/s)")
    m = r["memory"]
    lines.append(f"ridge {r['ridge']:,.0f} FLOP/B; {r['tokens_per_s']:,.0f} tokens/s; per GPU: weights "
                 f"{m['weights_bytes'] / 1e9:,.1f} GB + KV {m['kv_bytes'] / 1e9:,.1f} GB of "
                 f"{m['capacity_bytes'] / 1e9:,.1f} GB{'' if m['fits'] else ' (does not fit)'}")
    return "\n".join(lines)
