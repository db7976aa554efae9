"""weight_only_matmul: y = x @ (code · scale + zero)ᵀ, the weights read as integers, never as floats.

The CUDA path of backend/model/quant.py's QuantLinear (torch's int8/int4 matmuls are CPU kernels
there). A decode step is memory-bound: it streams every weight once for a few rows of x, so the
kernel reads the codes (int8: a byte a weight; int4: two weights a byte) and dequantizes each tile
in registers, right before its dot. Scales (and int4's zeros) are per (output row, group of K);
int8 with one scale per row is the group = K case.

int4 layout: quant.py's `pack_int4`, uint8 [N, K/2], weight 2j in the low nibble and 2j+1 in the
high one, as the code + 8 in 0..15. A tile of BLOCK_K weights is BLOCK_K/2 bytes, unpacked to two
[BLOCK_N, BLOCK_K/2] halves and interleaved back with tl.join.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); BLOCK_K divides the group size, so a tile has one scale
per output row. The dots are IEEE fp32 (activations upcast): exact under the interpreter, and on a
GPU no silent drop to tf32; a memory-bound decode step does not miss the tensor cores' speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels._util import INTERPRETING, pad16

BLOCK_K = 32  # the smallest group quant.py's int4 kernel layout takes: every group size is a multiple


# ---- torch reference ------------------------------------------------------------------------------


def weight_only_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int,
                                 zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K]; codes int8 [N, K]; scales (zeros) [N, K / group] -> [M, N] float32."""
    n, k = codes.shape
    w = codes.float().view(n, k // group, group) * scales.float()[..., None]
    if zeros is not None:
        w = w + zeros.float()[..., None]
    return x.float() @ w.view(n, k).T


# ---- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _weight_only_kernel(x_ptr, stride_xm, w_ptr, stride_wn, s_ptr, z_ptr, stride_sn, y_ptr, stride_ym,
                        M, N, K, GROUP: tl.constexpr, INT4: tl.constexpr, HAS_ZEROS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] of x and y
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]: output channels, rows of w
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0)
        if INT4:  # [BLOCK_N, BLOCK_K / 2] bytes -> low and high nibbles -> [BLOCK_N, BLOCK_K]
            bytes_ = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + cols[:, None] * stride_wn + bytes_[None, :], mask=col_ok[:, None], other=0)
            low = (packed & 15).to(tl.float32) - 8.0
            high = (packed >> 4).to(tl.float32) - 8.0
            w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
        else:
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None], other=0).to(tl.float32)
        g = k0 // GROUP  # BLOCK_K divides GROUP: one scale per output row in this tile
        scale = tl.load(s_ptr + cols * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        w = w * scale[:, None]
        if HAS_ZEROS:
            w = w + tl.load(z_ptr + cols * stride_sn + g, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")  # fp32, never tf32's 10-bit mantissa
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def weight_only_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int,
                       zeros: torch.Tensor | None = None, int4: bool = False) -> torch.Tensor:
    """x [M, K]; weight int8 codes [N, K] or (int4) pack_int4's uint8 [N, K / 2]; scales (zeros)
    [N, K / group] -> y [M, N] float32."""
    m, k = x.shape
    n = weight.shape[0]
    if group % BLOCK_K or k % group:
        raise ValueError(f"group {group} must be a multiple of {BLOCK_K} dividing K = {k}")
    x, weight, scales = x.contiguous().float(), weight.contiguous(), scales.contiguous()  # unit stride along K
    zeros = zeros.contiguous() if zeros is not None else scales  # a placeholder the kernel never reads
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_m = pad16(min(m, 64))
    block_n = 32 if INTERPRETING else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_only_kernel[grid](x, x.stride(0), weight, weight.stride(0), scales, zeros, scales.stride(0),
                              y, y.stride(0), m, n, k, GROUP=group, INT4=int4, HAS_ZEROS=zeros is not scales,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    return y
