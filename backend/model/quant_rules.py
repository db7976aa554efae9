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
