"""Weight-only quantization: every linear layer stored as int8 or packed int4 codes plus their scales.

Symmetric absmax: a group of `group_size` consecutive weights along the input dimension shares one
scale, `scale = max|w| / 127` (int8) or `max|w| / 7` (int4, codes in [-8, 7], two per byte), and
`w ~= code * scale`. group_size 0 is the per-tensor baseline: one scale for the whole matrix, so a
single outlier column stretches the grid for every weight; groups confine an outlier's damage to
its own group (docs/quantization.md).

What runs quantized: torch's own CPU kernels multiply by the integer weights directly, and no
float copy of a whole weight exists at any time (an int8 layer given 16 rows or more multiplies
bfloat16 tiles of 4 MiB at most instead: `int8_rows_matmul`):
- int8 per tensor (group_size 0) or one group per row (group_size = in_features): the scale is one
  per output channel, which is what `aten._weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])`
  takes (a per-tensor scale is repeated N times at forward, N numbers).
- int4 groups of 32, 64, 128 or 256 with out_features a multiple of 16:
  `aten._weight_int4pack_mm_for_cpu(x [M, K], w, group, scales_and_zeros [K / g, N, 2])`, `w` the
  uint8 [N, K / 2] that `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)` packs (its own
  nibble order, not pack_int4's). torch's int4 is asymmetric, `w = (q - 8) * scale + zero` with q in
  0..15, so a code c in [-8, 7] is q = c + 8: kvscope's symmetric codes have zero 0, and a GGUF
  file's Q4_1 block `d * q + m` is scale d, zero m + 8d (gguf_weights.py). The kernel reads the zeros
  interleaved with the scales, so a zero is stored per group even where it is 0.
Both kernels run in bfloat16: the activations are cast to it at the layer's edge, the scales (and
zeros) are stored in it, and the output comes back in bfloat16 and is cast to the caller's dtype.
Only that dtype has a vectorized loop in torch's CPU kernels (AVX-512 and AVX2): with float32 or
float16 activations they fall to a scalar loop 10-500x slower than bfloat16 (docs/quantization.md).
The price is bfloat16's 8-bit mantissa on each layer's input and output (a relative 2^-9); the
logits of a whole model stay within the tolerance docs/quantization.md states against the
dequantized float model. On CUDA the same layers run kernels/weight_matmul.py's Triton kernel
instead (`triton_forward`: the codes read as integers, each tile dequantized in registers). Every
other setting (int8 with groups smaller than a row, int4 per tensor or with other group sizes)
still dequantizes in `forward` and calls F.linear: only storage shrinks there. `QuantLinear.kernel`
names the layout a layer keeps.

`quantize_model` keeps the embedding in full precision; with tied embeddings lm_head gets its own
quantized copy. (A GGUF file run as stored reads its embedding as int8 rows instead: QuantEmbedding,
gguf_weights.py.) `quantize_model` never touches the caller's model (the server shares one
LoadedModel between runs).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvscope.backend.model.loaded import LoadedModel
from kvscope.backend.model.transformer import num_parameters
# QuantError: engine.py and the tests name it here, beside the quantizer that refuses a setting
from kvscope.backend.model.quant_rules import QuantError, QuantMode, check_group_size, kernel_for  # noqa: F401

QMAX = {"int8": 127, "int4": 7}  # absmax maps to this code
QMIN = {"int8": -127, "int4": -8}
KERNEL_DTYPE = torch.bfloat16  # the kernels' activations, scales and zeros: their only vectorized dtype
GEMM_ROWS = 16  # rows of activations from which an int8 layer multiplies bfloat16 tiles (int8_rows_matmul)
TILE_BYTES = 4 << 20  # one such tile's bfloat16 copy: bounded, whatever the layer's size


# ---- the quantizer ----------------------------------------------------------------------------------


def quantize_weight(w: torch.Tensor, mode: QuantMode, group_size: int,
                    scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes int8 [N, K] in [QMIN, QMAX], scales [N, K / group_size] or [1, 1] in scale_dtype).

    The codes are rounded against the scales as stored (a bfloat16 scale for a kernel layer), so
    `code * scale` is the nearest grid point of the grid the layer really computes with."""
    n, k = w.shape
    g = group_size or k * n  # per-tensor: the whole matrix is one group
    groups = w.float().reshape(-1, g)  # [N * K / g, g]
    scales = (groups.abs().amax(dim=1) / QMAX[mode]).to(scale_dtype).float()  # [N * K / g]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
    codes = torch.round(groups / safe[:, None]).clamp(QMIN[mode], QMAX[mode]).to(torch.int8)
    shape = (n, k // group_size) if group_size else (1, 1)
    return codes.reshape(n, k), scales.reshape(shape).to(scale_dtype)


def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, group_size: int,
                      zeros: torch.Tensor | None = None) -> torch.Tensor:
    """codes [N, K] int8, scales (and zeros) [N, K / g] (or [1, 1]) -> float32 [N, K]: code * scale + zero."""
    if not group_size:
        return codes.float() * scales.float()
    n, k = codes.shape
    w = codes.float().view(n, k // group_size, group_size) * scales.float()[..., None]
    return (w if zeros is None else w + zeros.float()[..., None]).view(n, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7], K even -> uint8 [N, K / 2]: column 2j in the low nibble, 2j+1 high."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)  # [N, K] in [0, 15]
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> int8 codes [N, K] in [-8, 7] (the exact inverse of pack_int4)."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)  # interleave back: [N, K / 2, 2] -> [N, K]


# ---- the int8 matmul --------------------------------------------------------------------------------


def int8_rows_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 @ (codes int8 [N, K] * scales [N]).T -> [M, N] (bfloat16, or float32 from GEMM_ROWS up).

    torch's int8 kernel computes each row of x as a GEMV of its own, reading every weight once per row:
    its time grows with M (SmolLM2's 28 MB lm_head: 2.5 ms for one row, 23 ms for 32). From GEMM_ROWS
    rows up (a prefill chunk, a wide decode batch) `int8_tiles_matmul` reads each weight once for all
    rows. A compiled decode graph keeps torch's kernel at every batch size: a branch on its symbolic
    batch would guard the graph on it, and a batch on the other side would compile a second mid-run."""
    if torch.compiler.is_compiling() or x.shape[0] < GEMM_ROWS:  # no guard on a compiled graph's batch
        return torch.ops.aten._weight_int8pack_mm(x, codes, scales)
    return int8_tiles_matmul(x, codes, scales)


def int8_tiles_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same product as one GEMM per tile of rows: each tile of codes widened to bfloat16 (exactly:
    bfloat16 holds -127..127; TILE_BYTES at most, whatever the layer's size), multiplied by all of x at
    once, and the scales applied after, in float32. -> float32 [M, N]. `python -m bench.q8_routes` times
    both routes by rows of x."""
    rows = max(1, TILE_BYTES // (2 * codes.shape[1]))  # a tile's bfloat16 copy: TILE_BYTES at most
    xt = x.T  # [K, M]
    parts = [codes[start:start + rows].to(KERNEL_DTYPE) @ xt for start in range(0, codes.shape[0], rows)]  # [rows, M]
    return (torch.cat(parts).float() * scales.float()[:, None]).T  # [N, M] -> [M, N]


# ---- the module ------------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized; torch's int8/int4 kernels compute with it where
    the settings allow (`kernel`), otherwise it is dequantized on every forward."""

    def __init__(self, in_features: int, out_features: int, mode: QuantMode, group_size: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        assert mode in QMAX, mode
        self.in_features, self.out_features, self.mode, self.group_size = in_features, out_features, mode, group_size
        self.dtype = dtype  # what the dequantized weight (and `.weight`) come back as
        self.kernel = kernel_for(mode, group_size, in_features, out_features)
        n, k = out_features, in_features
        packed_k = k // 2 if mode == "int4" else k
        self.register_buffer("qweight", torch.zeros(n, packed_k, dtype=torch.uint8 if mode == "int4" else torch.int8))
        if self.kernel == "int4pack":  # torch's layout: [K / g, N, (scale, zero)]
            self.register_buffer("scales_and_zeros", torch.zeros(k // group_size, n, 2, dtype=KERNEL_DTYPE))
        else:
            shape = (n, k // group_size) if group_size else (1, 1)
            self.register_buffer("scales", torch.zeros(shape, dtype=self.scale_dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def scale_dtype(self) -> torch.dtype:
        """What the scales are stored in: the kernels' bfloat16, or float32 where forward dequantizes."""
        return KERNEL_DTYPE if self.kernel else torch.float32

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: QuantMode, group_size: int, name: str = "weight") -> "QuantLinear":
        """Quantize a float nn.Linear (which is left as it was)."""
        check_group_size(linear.in_features, group_size, mode, name)
        q = cls(linear.in_features, linear.out_features, mode, group_size, linear.bias, linear.weight.dtype)
        codes, scales = quantize_weight(linear.weight.detach(), mode, group_size, q.scale_dtype)
        return q.load_codes(codes, scales).to(linear.weight.device)

    def load_codes(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> "QuantLinear":
        """Store codes int8 [N, K] (int4: in [-8, 7]) and scales [N, K / g] (or [1, 1]) in this layer's layout;
        `w = code * scale + zero`, zeros [N, K / g] only where the int4 kernel takes them. Returns self."""
        assert zeros is None or self.kernel == "int4pack", "only torch's int4 layout stores zeros"
        if self.kernel == "int4pack":
            self.qweight.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.cpu().to(torch.int32) + 8, 1))
            self.scales_and_zeros[..., 0].copy_(scales.T)
            if zeros is not None:
                self.scales_and_zeros[..., 1].copy_(zeros.T)
        else:
            self.qweight.copy_(pack_int4(codes) if self.mode == "int4" else codes)
            self.scales.copy_(scales)
        return self

    def group_scales(self) -> torch.Tensor:
        """The scales [out_features, in_features / group_size] (or [1, 1] per tensor)."""
        return self.scales_and_zeros[..., 0].T if self.kernel == "int4pack" else self.scales

    def group_zeros(self) -> torch.Tensor | None:
        """The zeros [out_features, in_features / group_size] of torch's int4 layout (None elsewhere)."""
        return self.scales_and_zeros[..., 1].T if self.kernel == "int4pack" else None

    def codes(self) -> torch.Tensor:
        """The integer codes [out_features, in_features], int8."""
        if self.kernel == "int4pack":  # torch's packing is opaque: multiply the identity, scale 1, zero 0
            ones = torch.zeros(self.scales_and_zeros.shape, dtype=KERNEL_DTYPE)
            ones[..., 0] = 1
            codes_t = torch.ops.aten._weight_int4pack_mm_for_cpu(  # bfloat16 holds -8..7 exactly, and is fast
                torch.eye(self.in_features, dtype=KERNEL_DTYPE), self.qweight.cpu(), self.group_size, ones)  # [K, N]
            return codes_t.T.round().to(torch.int8).to(self.qweight.device)
        return unpack_int4(self.qweight) if self.mode == "int4" else self.qweight

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [out_features, in_features] (MLA's absorbed form reads it directly)."""
        w = dequantize_weight(self.codes(), self.group_scales(), self.group_size, self.group_zeros())
        return w.to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.device.type == "cuda":
            return self.triton_forward(x)
        if self.kernel is None or x.device.type != "cpu":
            w = self.weight.to(x.dtype)  # [out, in]: a transient full-precision copy, freed after the matmul
            return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # [M, K]: the kernels take 2-D activations only
        if self.kernel == "int8pack":
            y = int8_rows_matmul(flat, self.qweight, self.row_scales())
        else:
            # .contiguous(): a joined part's scales are a column slice of its group's (joined.py), and the
            # kernel reads a strided one as if it were dense, silently wrong
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size,
                                                           self.scales_and_zeros.contiguous())
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., N]
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def triton_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The CUDA path: kernels/weight_matmul.py reads the codes and dequantizes each tile in registers.
        int8 codes are device-neutral; torch's int4 packing is a CPU layout, so an int4 layer packs its
        codes once more, two a byte in pack_int4's order, on first use (N * K / 2 bytes beside it)."""
        from kvscope.kernels.weight_matmul import weight_only_matmul  # triton: only where it runs

        flat = x.reshape(-1, self.in_features)  # [M, K]
        if self.kernel == "int8pack":
            y = weight_only_matmul(flat, self.qweight, self.row_scales()[:, None], self.in_features)
        else:
            if getattr(self, "portable_int4", None) is None:
                self.register_buffer("portable_int4", pack_int4(self.codes()), persistent=False)
            y = weight_only_matmul(flat, self.portable_int4, self.group_scales(), self.group_size,
                                   self.group_zeros(), int4=True)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def row_scales(self) -> torch.Tensor:
        """int8: one scale per output channel [out_features], a per-tensor scale repeated."""
        return self.scales.reshape(-1).expand(self.out_features).contiguous() if not self.group_size \
            else self.scales.reshape(self.out_features)

    def extra_repr(self) -> str:
        group = self.group_size or "per-tensor"
        kernel = self.kernel or "dequantize"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}, group={group}, {kernel}"


class QuantEmbedding(nn.Module):
    """A token embedding read from int8 codes: row t is `codes[t] * scales[t]`, dequantized for the ids
    looked up only ([T, hidden] floats per step, never the [vocab, hidden] table). With tied embeddings
    it reads the output layer's own int8 rows (`tied_to`): one copy of the matrix serves both ends."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("codes", codes)  # [vocab, hidden] int8
        self.register_buffer("scales", scales.reshape(-1, 1))  # [vocab, 1]

    @classmethod
    def tied_to(cls, lm_head: QuantLinear) -> "QuantEmbedding":
        assert lm_head.kernel == "int8pack" and lm_head.group_size, "a tied embedding reads int8 rows"
        return cls(lm_head.qweight, lm_head.scales, lm_head.dtype)  # the same tensors: no second copy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.codes[ids].to(self.dtype) * self.scales[ids].to(self.dtype))  # [..., T, hidden]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (tests and the quality bench compare it; the forward never builds it)."""
        return self.codes.to(self.dtype) * self.scales.to(self.dtype)


# ---- whole models ----------------------------------------------------------------------------------


def quantize_model(model: nn.Module, mode: QuantMode, group_size: int) -> nn.Module:
    """A copy of `model` with every nn.Linear replaced by a QuantLinear; `model` itself is untouched.

    The copy shares nothing with the original: the quantized layers are built from the original
    weights and slotted in through deepcopy's memo, so no full-precision copy of them is ever made;
    everything else (embedding, norms, buffers) is deep-copied. A tied lm_head becomes its own
    QuantLinear while the copied embedding keeps full precision.
    """
    if mode == "none":
        return copy.deepcopy(model)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, m in linears:  # all checks first, so an error leaves nothing half-built
        check_group_size(m.in_features, group_size, mode, name)
    memo = {id(m): QuantLinear.from_linear(m, mode, group_size, name) for name, m in linears}
    return copy.deepcopy(model, memo)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's stored tensors (parameters and persistent buffers), shared storage once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.data_ptr(), t.nbytes)  # a tied weight appears twice with one pointer
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def quantize_loaded(loaded: LoadedModel, mode: QuantMode, group_size: int) -> tuple[LoadedModel, dict]:
    """(a LoadedModel running the quantized copy, the header's `weights` summary).

    mode "none" returns `loaded` itself. The caller's LoadedModel and its model are never changed.
    A GGUF file loaded natively is already quantized: its summary says how (`gguf`, `layers`).
    """
    if loaded.gguf_types is not None:
        return loaded, native_summary(loaded)
    unquantized = weight_bytes(loaded.model)
    model = loaded.model if mode == "none" else quantize_model(loaded.model, mode, group_size)
    summary = {"quant": mode, "group_size": group_size if mode != "none" else None, "layers": layer_kinds(model),
               "bytes": weight_bytes(model), "bytes_unquantized": unquantized}
    return (loaded if mode == "none" else dataclasses.replace(loaded, model=model)), summary


def layer_kinds(model: nn.Module) -> dict[str, int]:
    """How many linear layers run each way: {"int4 g32": 210, "int8 per row": 1, "float32": 0}."""
    kinds: Counter[str] = Counter()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            kinds[f"{m.mode} " + ("per row" if m.group_size == m.in_features else f"g{m.group_size}" if m.group_size
                                  else "per tensor")] += 1
        elif isinstance(m, nn.Linear):
            kinds[str(m.weight.dtype).removeprefix("torch.")] += 1
    return dict(kinds)


def native_summary(loaded: LoadedModel) -> dict:
    """The header's `weights` for a GGUF file run as stored: its tensor types, the layers they became, the
    bytes held, and a float32 copy's bytes to compare with."""
    kinds = layer_kinds(loaded.model)
    main = max(kinds, key=kinds.get)  # the perf model prices the run by its most common layer (docs/perf_model.md)
    mode, _, grouping = main.partition(" ")  # "int4 g32", "int8 per row", "float32"
    group = int(grouping[1:]) if grouping.startswith("g") else None
    lm_head = next(iter(layer_kinds(loaded.model.lm_head)))  # "int8 per row": SmolLM2's Q8_0 embedding
    return {"quant": mode if mode in QMAX else "none", "group_size": group, "lm_head": lm_head,
            "gguf": loaded.gguf_types, "layers": kinds, "bytes": weight_bytes(loaded.model),
            "bytes_unquantized": num_parameters(loaded.config) * 4}


def gguf_summary(types: dict[str, int]) -> str:
    """"Q4_1 ×210, Q8_0 ×1": a GGUF file's quantized tensor types (the float norms left out)."""
    quantized = sorted(((t, n) for t, n in types.items() if not t.startswith(("F", "BF"))), key=lambda tn: -tn[1])
    return ", ".join(f"{t} ×{n}" for t, n in quantized)
