"""Small helpers the kernel modules share: constants, padding, tile sizes, the interpreter switch."""

from __future__ import annotations

import os

import torch
import triton.language as tl

# Under TRITON_INTERPRET=1 (CPU), bf16 tl.dot returns garbage and fp32 is the only exact choice; on
# a GPU an fp32 model still wants IEEE dots (tf32 would change greedy tokens against the torch path).
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

# Masked scores are -inf, but the running max starts finite: a row that has seen no key yet (padding
# rows, empty splits) then rescales by exp2(m - m_new) = 1, not exp2(-inf + inf) = nan.
# tl.constexpr: the Triton compiler refuses plain Python globals in a kernel (the interpreter does not).
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


def pad16(n: int) -> int:
    """The power of two >= max(n, 16): tl.arange wants powers of two, tl.dot at least 16 per side."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def dot_in_fp32(q_dtype: torch.dtype) -> bool:
    """Upcast dot operands to fp32 (IEEE): always when interpreting, and for fp32 models on a GPU."""
    return INTERPRETING or q_dtype == torch.float32


def default_tile(dtype: torch.dtype) -> int:
    """Tokens per K/V tile: 64 for 16-bit values; fp32 tiles take twice the shared memory, so 32."""
    return 32 if dtype == torch.float32 else 64


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
