"""Which weight quantization settings a model's shapes allow (quant.py stores the weights that way).

Apart from quant.py because the rules are arithmetic on shapes and need no torch: the cost model
checks a what-if's settings with them, and the dashboard, which prices runs, never imports torch.
"""

from __future__ import annotations

from typing import Literal

from kvscope.backend.errors import KvscopeError

QuantMode = Literal["none", "int8", "int4"]


class QuantError(KvscopeError):
    """A quantization setting that cannot apply to this model: the config field and the reason."""


def check_group_size(in_features: int, group_size: int, mode: QuantMode, name: str = "weight") -> None:
    """Refuse a group size that does not tile the input dimension (no silent padding)."""
    if group_size < 0:
        raise QuantError("engine.quant_group_size", f"must be >= 0 (0 = one scale per tensor), got {group_size}")
    if group_size and in_features % group_size:
        raise QuantError("engine.quant_group_size",
                         f"{group_size} does not divide the input dimension {in_features} of {name}; "
                         f"use a divisor of it (e.g. 32 or 64) or 0 for one scale per tensor")
    if mode == "int4" and in_features % 2:
        raise QuantError("engine.weight_quant", f"int4 packs two weights per byte; {name} has an odd input "
                         f"dimension {in_features}")


INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # what torch's _weight_int4pack_mm_for_cpu accepts


def kernel_for(mode: QuantMode, group_size: int, in_features: int, out_features: int) -> str | None:
    """Which torch CPU kernel computes a layer with these settings: "int8pack", "int4pack" or None
    (quant.py dequantizes). It also decides the layout: an int4pack layer stores a zero per group."""
    if mode == "int8" and group_size in (0, in_features):
        return "int8pack"  # one scale per output channel (a per-tensor scale repeats)
    if mode == "int4" and group_size in INT4_KERNEL_GROUPS and out_features % 16 == 0:
        return "int4pack"  # torch's packer tiles the output dimension by 16
    return None
