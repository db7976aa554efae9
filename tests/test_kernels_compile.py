"""The kernels build for a real GPU: each one compiled ahead of time to a cubin, on this CPU.

The interpreter checks the arithmetic but accepts things the compiler refuses (tl.dot smaller than
16x16x16, plain Python globals in a kernel, shared memory over the device's limit). Triton's wheel
carries its NVIDIA backend and ptxas, so compiling needs no GPU: a child process without
TRITON_INTERPRET records the launches the host wrappers make (nothing runs) and compiles each
for sm_90 (H100) and sm_80 (A100), at the engine's tiny shapes and at a Llama-size one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NO_NVIDIA_BACKEND = 77
SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024}  # usable bytes per block


def shapes():
    import torch

    # (dtype, query heads, KV heads, head dim, block size, int8 cache)
    return [(torch.bfloat16, 32, 8, 128, 16, False),  # Llama-3-8B
            (torch.bfloat16, 32, 8, 128, 16, True),
            (torch.float16, 8, 1, 80, 3, True),  # MQA, head dim and block size not powers of two
            (torch.float32, 4, 2, 16, 4, False)]  # the tests' tiny model: IEEE fp32 dots


def test_every_kernel_compiles_for_sm90_and_sm80():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode == NO_NVIDIA_BACKEND:
        pytest.skip("this triton has no NVIDIA backend")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "compiled" in proc.stdout


# ---- the child process ----------------------------------------------------------------------------


def record_launches() -> list[tuple]:
    """Call every host wrapper on CPU tensors with kernel launches swapped for a recorder."""
    import torch

    from kvscope.kernels import cache_write, mla_decode, paged_decode, paged_prefill, weight_matmul

    launches = []
    for kernel in (paged_decode._decode_split_kernel, paged_decode.combine_splits_kernel,
                   paged_prefill._prefill_kernel, mla_decode._mla_decode_split_kernel, cache_write._write_kv_kernel,
                   weight_matmul._weight_only_kernel):
        kernel.run = lambda *args, grid, warmup, _k=kernel, **kw: launches.append((_k, args, kw))
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    for dtype, hq, hkv, d, block_size, quant in shapes():
        q = torch.zeros(2, hq, d, dtype=dtype)
        kv = torch.zeros(8, block_size, hkv, d, dtype=torch.int8 if quant else dtype)
        ks = torch.ones(8, block_size, hkv) if quant else None
        paged_decode.paged_decode_attention(q, kv, kv, tables, lens, 0.1, ks, ks, num_splits=2)
        paged_prefill.paged_prefill_attention(q, kv, kv, tables, starts, lens, 0.1, ks, ks)
        cache_write.write_kv_cache(q[:, :hkv], q[:, :hkv], kv, kv, torch.zeros(2, dtype=torch.long), ks, ks)
    for m, k, n, group in [(1, 4096, 14336, 32), (16, 576, 1536, 576), (64, 1536, 576, 64)]:  # weight-only matmuls
        x, scales = torch.zeros(m, k, dtype=torch.bfloat16), torch.ones(n, k // group, dtype=torch.bfloat16)
        weight_matmul.weight_only_matmul(x, torch.zeros(n, k // 2, dtype=torch.uint8), scales, group, scales.clone(),
                                         int4=True)
        weight_matmul.weight_only_matmul(x, torch.zeros(n, k, dtype=torch.int8), scales, group)
    for dtype, heads, rank, rope in [(torch.bfloat16, 128, 512, 64), (torch.float32, 4, 16, 8)]:
        latent = torch.zeros(8, 4, 1, rank + rope, dtype=dtype)
        q = torch.zeros(2, heads, rank + rope, dtype=dtype)
        mla_decode.mla_decode_attention(q, latent, tables, lens, rank, 0.1, num_splits=2)
    return launches


def compile_launch(kernel, args, kwargs, arch: int):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
             torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constants = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + types[value.dtype]
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32))


def main() -> int:
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        return NO_NVIDIA_BACKEND
    for arch in (90, 80):
        for kernel, args, kwargs in record_launches():
            compiled = compile_launch(kernel, args, kwargs, arch)
            assert compiled.metadata.shared <= SHARED_MEMORY[arch], (kernel.__name__, compiled.metadata.shared)
    print("compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
