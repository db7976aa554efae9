"""Quantized weights at run time: one batch-1 decode step in float32, int8 and int4, and the memory.

    OMP_NUM_THREADS=2 python -m bench.quant_speed [--model smollm2] [--steps 20] [--json OUT.json]

Each row runs in a fresh process (so its RSS is its own): load the model, quantize a copy
(backend/model/quant.py), drop the float model, then time `--steps` forwards of one token (context 1,
the dense backend: the step is the linear layers and lm_head, which is what quantization changes)
after 3 warm-up steps, and report the median. "kernel" rows run torch's int8pack / int4pack CPU
kernels (in bfloat16, quant.py); "dequantize" rows force the old path (dequantize each weight in
float32, then F.linear), whose scales stay float32, so its codes may differ by one step where a
bfloat16 scale rounds across a boundary; their logits are the reference the kernel rows are
compared with. A GGUF model (the default, SmolLM2) is de-quantized to float32 first for every row
but the last, which runs the file as it stores it (backend/model/gguf_weights.py).
Columns: weight bytes (state_dict), the process's RSS once the float model is dropped (and glibc
has returned its pages; a bare `python -c "import torch, kvscope"` is the floor), and the
RSS the first forward leaves behind (the dequantizing path's float copy of each weight is
transient, freed after its matmul, so it barely shows there: tests/test_quant.py checks instead
that a kernel layer never dequantizes).
bench/quant.py measures the quality of the same settings.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

ROWS = [  # (name, mode, group_size, path); SmolLM2's 576 refuses g128
    ("float32", "none", 0, "-"),
    ("int8 per tensor", "int8", 0, "kernel"),
    ("int8 per tensor", "int8", 0, "dequantize"),
    ("int4 g32", "int4", 32, "kernel"),
    ("int4 g64", "int4", 64, "kernel"),
    ("int4 g64", "int4", 64, "dequantize"),
    ("GGUF file as stored", "native", 0, "kernel"),  # SmolLM2's Q4_1 blocks as int4 g32, Q8_0 as int8 rows
]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def release_freed_memory() -> None:
    """glibc keeps freed heap pages (the float model's) in the process: hand them back, so RSS counts what is live."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS then overstates every quantized row
        pass


def one_row(model_name: str, mode: str, group_size: int, path: str, steps: int) -> dict:
    """Run in a child process: time one row, return its numbers and the first step's logits."""
    from kvscope.backend.model import quant
    from kvscope.backend.model.attention import DenseCausalBackend
    from kvscope.backend.model.loader import load_model

    if path == "dequantize":
        quant.kernel_for = lambda *args: None  # quant.py reads it from its own module: every layer dequantizes
    if mode == "native":  # the GGUF file's own blocks (a folder model loads as stored: its floats)
        loaded = load_model(model_name)
        model = loaded.model
    else:  # every other row quantizes the float32 weights (a GGUF file de-quantized)
        loaded = load_model(model_name, weights="float32")
        model = loaded.model if mode == "none" else quant.quantize_model(loaded.model, mode, group_size)
    del loaded
    gc.collect()
    release_freed_memory()
    model.eval()
    resident = rss_mb()  # the quantized copy, the embedding, torch itself: no float model any more
    ids = torch.tensor([1])  # [1]: one token at position 0
    dense = DenseCausalBackend()
    before = rss_mb()
    times = []
    with torch.inference_mode():
        for i in range(steps + 3):
            t = time.perf_counter()
            logits = model.logits(model(ids, ids * 0, dense))  # [1, vocab]
            times.append(time.perf_counter() - t)
            if i == 0:
                first, after_first = logits.clone(), rss_mb()
    return {"ms": 1000 * statistics.median(times[3:]), "bytes": quant.weight_bytes(model),
            "rss_mb": resident, "first_step_rss_mb": after_first - before, "logits": first.flatten().tolist()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--row", type=int, help=argparse.SUPPRESS)  # the child process's row
    args = ap.parse_args(argv)
    if args.row is not None:
        name, mode, group_size, path = ROWS[args.row]
        print(json.dumps(one_row(args.model, mode, group_size, path, args.steps)))
        return
    results = []
    for i, row in enumerate(ROWS):
        out = subprocess.run([sys.executable, "-m", "bench.quant_speed", "--model", args.model, "--steps",
                              str(args.steps), "--row", str(i)], capture_output=True, text=True, check=True)
        results.append(dict(zip(("name", "mode", "group_size", "path"), row)) | json.loads(out.stdout.splitlines()[-1]))
    report(results, args)


def report(results: list[dict], args) -> None:
    base = results[0]["ms"]
    reference = {r["name"]: torch.tensor(r["logits"]) for r in results if r["path"] == "dequantize"}
    print(f"model {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"batch 1, context 1, median of {args.steps} steps")
    print("| weights | path | ms / step | vs float32 | weight MB | RSS after load MB | first step adds MB | "
          "max |logit - dequantize path| |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        ref = reference.get(r["name"])
        diff = "" if ref is None else f"{(torch.tensor(r['logits']) - ref).abs().max().item():.2e}"
        print(f"| {r['name']} | {r['path']} | {r['ms']:.1f} | {base / r['ms']:.2f}x | {r['bytes'] / 2**20:.1f} | "
              f"{r['rss_mb']:.0f} | {r['first_step_rss_mb']:.0f} | {diff} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "logits"} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
