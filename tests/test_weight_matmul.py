"""kernels/weight_matmul.py under the Triton interpreter: the weight-only matmul (int8 rows, int4 groups
with zeros) against its torch reference, and QuantLinear's CUDA path (triton_forward) against the
layer's own dequantized weight. The interpreter runs the kernel on the CPU exactly as written."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")

from kvscope.backend.model.quant import QuantLinear, pack_int4  # noqa: E402
from kvscope.kernels.weight_matmul import weight_only_matmul, weight_only_matmul_reference  # noqa: E402

CASES = [  # (M, K, N, group, int4, zeros): decode rows, a prefill block, ragged N, per-row int8
    (1, 64, 48, 32, True, True), (5, 128, 40, 64, True, True), (17, 96, 32, 32, True, False),
    (3, 64, 33, 64, False, False), (2, 96, 24, 32, False, False),
]


@pytest.mark.parametrize("m, k, n, group, int4, with_zeros", CASES)
def test_weight_only_matmul_matches_its_reference(m, k, n, group, int4, with_zeros):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    codes = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8) if int4 else \
        torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zeros = torch.randn(n, k // group, generator=gen) * 0.05 if with_zeros else None
    x = torch.randn(m, k, generator=gen)
    weight = pack_int4(codes) if int4 else codes
    got = weight_only_matmul(x, weight, scales, group, zeros, int4=int4)
    want = weight_only_matmul_reference(x, codes, scales, group, zeros)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_group_the_tiles_cannot_take_is_refused():
    with pytest.raises(ValueError, match="group 16"):
        weight_only_matmul(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 4), 16)


@pytest.mark.parametrize("mode, group_size", [("int8", 0), ("int8", 128), ("int4", 32), ("int4", 64)])
def test_quant_linears_cuda_path_computes_its_own_weight(mode, group_size):
    """triton_forward is what forward runs on CUDA; here the interpreter runs it on the CPU."""
    torch.manual_seed(7)
    linear = nn.Linear(128, 48, bias=True)
    q = QuantLinear.from_linear(linear, mode, group_size)
    assert q.kernel is not None
    x = torch.randn(3, 5, 128)
    want = nn.functional.linear(x, q.weight, q.bias)  # the layer's own codes and scales, in float32
    torch.testing.assert_close(q.triton_forward(x), want, atol=1e-4, rtol=1e-4)
