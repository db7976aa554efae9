"""Q, K and V as one matmul, and gate and up as one: fewer, bigger ops in every step.

A decode step multiplies one row of activations by every weight matrix, so its cost is a fixed price
per matmul (dispatch, casts, a kernel launch on a GPU) plus the bytes each reads. Q, K and V read the
same input, as do the MLP's gate and up: vLLM stores each group as one matrix (`QKVParallelLinear`,
`MergedColumnParallelLinear`) and splits the output. kvscope keeps Hugging Face's separate modules,
so checkpoints, tensor-parallel shards, the perf model and the lessons name them as papers do, and
lays their rows side by side in one buffer instead (`join_projections`): each part's weight becomes a
view of its rows, the joined layer reads the whole buffer, and no byte is stored twice.

A joined layer is only used while its parts still view its buffer: a model copied by
quantization or sharding (new modules) or moved to another device (new tensors) runs its parts one
by one until it is joined again, so no path can compute with weights its parts no longer hold.
The runner joins the model it is given (runner.py), on every rank of a tensor-parallel run after
its shard was cut: each rank's Q, K, V are already its own heads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class Joined:
    """One layer over several layers' output rows, sharing their storage."""

    layer: nn.Module  # an nn.Linear or QuantLinear with out_features = sum(sizes)
    sizes: list[int]  # each part's out_features, in order: where the output splits
    ptrs: tuple[int, ...]  # each part's row tensor's address once joined: any other means it was replaced

    def holds(self, parts: tuple[nn.Module, ...]) -> bool:
        return tuple(rows(p).data_ptr() for p in parts) == self.ptrs and rows(self.layer).data_ptr() == self.ptrs[0]


def project(x: torch.Tensor, parts: tuple[nn.Module, ...], joined: Joined | None) -> tuple[torch.Tensor, ...]:
    """Each part's output for x [..., in]: one matmul where the parts are joined, else one per part.
    Inside torch.compile the check is skipped (an address cannot be traced): the compiled decode
    (runner.py) runs only models its runner joined as it started, and nothing moves them after."""
    if joined is not None and (torch.compiler.is_compiling() or joined.holds(parts)):
        return joined.layer(x).split(joined.sizes, dim=-1)  # views of [..., sum(sizes)]
    return tuple(p(x) for p in parts)


def rows(layer: nn.Module) -> torch.Tensor:
    """The tensor whose rows are the layer's output channels: a QuantLinear's codes, or the weight."""
    return layer.qweight if hasattr(layer, "qweight") else layer.weight


# The tensors of each kind of layer that hold one row (float) or one column (torch's int4 scales,
# [K / g, N, 2]) per output channel: joined along that dimension.
ROW_TENSORS = {"weight": 0, "bias": 0, "qweight": 0, "scales": 0, "scales_and_zeros": 1}

_lock = threading.Lock()  # two runs built at once over one shared model join it once


def join_projections(model: nn.Module) -> int:
    """Join every attention's Q, K, V and every MLP's gate, up in place; returns how many groups are
    joined now. Idempotent, and safe while another thread steps the same model: the weights' values
    never change, only where they live."""
    joined = 0
    with _lock:
        for module in model.modules():
            group = _group_of(module)
            if group is None:
                continue
            current = module.joined
            if current is None or not current.holds(group):
                module.joined = join(group)
            joined += module.joined is not None
    return joined


def _group_of(module: nn.Module) -> tuple[nn.Module, ...] | None:
    if hasattr(module, "joined") and hasattr(module, "v_proj"):
        return module.q_proj, module.k_proj, module.v_proj
    if hasattr(module, "joined") and hasattr(module, "up_proj"):
        return module.gate_proj, module.up_proj
    return None


def join(parts: tuple[nn.Module, ...]) -> Joined | None:
    """One layer over the parts' rows, the parts' tensors made views of it; None where they cannot be."""
    if not joinable(parts):
        return None
    first = parts[0]
    sizes = [p.out_features for p in parts]
    with torch.device("meta"):  # the joined layer's own tensors are replaced below: allocate nothing
        layer = _like(first, sum(sizes))
    if getattr(layer, "kernel", None) != getattr(first, "kernel", None):
        return None  # the kernel a layer runs depends on its shape (quant_rules.kernel_for)
    for name, dim in ROW_TENSORS.items():
        tensors = [_own(p, name) for p in parts]
        if tensors[0] is None:
            continue
        whole = torch.cat([t.detach() for t in tensors], dim=dim)
        _set(layer, name, whole)
        for p, view in zip(parts, whole.split(sizes, dim=dim)):
            _set(p, name, view)
    return Joined(layer, sizes, tuple(rows(p).data_ptr() for p in parts))


def joinable(parts: tuple[nn.Module, ...]) -> bool:
    first = parts[0]
    if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        return False
    tensors = [rows(p) for p in parts]
    if any(t.dtype != tensors[0].dtype or t.device != tensors[0].device for t in tensors):
        return False
    if any((getattr(p, "bias", None) is None) != (getattr(first, "bias", None) is None) for p in parts):
        return False
    if not hasattr(first, "qweight"):
        return True  # nn.Linear
    if any((p.mode, p.group_size, p.kernel) != (first.mode, first.group_size, first.kernel) for p in parts):
        return False
    if not first.group_size:
        return False  # one scale per tensor: the parts' scales differ and the joined layer would hold one
    return first.kernel != "int4pack" or int4pack_separable([p.out_features for p in parts], first.in_features)


def int4pack_separable(sizes: list[int], k: int) -> bool:
    """Whether torch's CPU int4 packing of stacked matrices equals the stacked packings. It packs rows in
    blocks whose size depends on the CPU (64 with AVX-512): true when every part is whole blocks. Asked
    of the kernel itself, on random codes of these shapes, rather than assuming a block size."""
    codes = [torch.randint(0, 16, (n, k), dtype=torch.int32) for n in sizes]
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    return torch.equal(pack(torch.cat(codes), 1), torch.cat([pack(c, 1) for c in codes]))


def _like(layer: nn.Module, out_features: int) -> nn.Module:
    if hasattr(layer, "qweight"):
        return type(layer)(layer.in_features, out_features, layer.mode, layer.group_size, dtype=layer.dtype)
    return nn.Linear(layer.in_features, out_features, bias=layer.bias is not None, dtype=layer.weight.dtype)


def _own(layer: nn.Module, name: str) -> torch.Tensor | None:
    """The layer's own parameter or buffer of that name (not a property: QuantLinear.weight dequantizes)."""
    return layer._parameters.get(name, layer._buffers.get(name))


def _set(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in layer._parameters:
        layer._parameters[name] = nn.Parameter(tensor, requires_grad=layer._parameters[name].requires_grad)
    else:
        layer._buffers[name] = tensor
