"""A GGUF file's weights at their own precision: each quantized matrix becomes a QuantLinear that
torch's int4 / int8 CPU kernels multiply by directly, so no float copy of it exists after load.

How each tensor type is stored (`--weights native`, the default for a .gguf file):

| GGUF type | a block of 32 weights | kvscope layer | exact? |
| --- | --- | --- | --- |
| Q4_0 | `w = d · (q - 8)`, q in 0..15 | int4, groups of 32: scale d, zero 0 | codes exact, scales rounded to bf16 |
| Q4_1 | `w = d · q + m` | int4, groups of 32: scale d, zero m + 8d | the same |
| Q4_K | 8 such groups, `d·sc_j · q - dmin·m_j` | int4, groups of 32: scale d·sc_j, zero 8·d·sc_j - dmin·m_j | the same |
| Q8_0, Q5_*, Q6_K | `w = d · q` with 5-8 bit q | int8, one scale per row, re-quantized | no: the error is measured |
| F32, F16, BF16 | the floats | float32 nn.Linear | yes |

torch's int4 kernel computes `(q - 8) · scale + zero` (quant.py), which holds Q4_0, Q4_1 and Q4_K
blocks exactly: only their float16 scales are rounded to the kernel's bfloat16. Its int8 kernel
takes one scale per output row, not per 32 weights, so 8-bit and odd-width blocks are dequantized
here once and quantized again per row (docs/quantization.md has the measured KL). A Q4 matrix
whose rows are not a multiple of 16 (the int4 packer's tile) takes the int8 path too.

The token embedding reads int8 rows (QuantEmbedding); with tied embeddings it reads the output
layer's own rows, so SmolLM2's Q8_0 `token_embd` is one int8 matrix serving both ends.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from gguf import GGML_QUANT_SIZES, ReaderTensor
from gguf.quants import Q4_K, dequantize

from kvscope.backend.config import ModelConfig
from kvscope.backend.model.gguf_loader import (PERMUTED_ARCHITECTURES, Q, dequantize_tensor,
                                               hf_tensor_name, open_gguf, unpermute_rope_rows)
from kvscope.backend.model.quant import QuantEmbedding, QuantLinear, quantize_weight
from kvscope.backend.model.quant_rules import kernel_for
from kvscope.backend.model.transformer import CausalLM

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
GROUP = 32  # every INT4_TYPES block is groups of 32 weights along a row


# ---- one tensor -------------------------------------------------------------------------------------


def int4_groups(t: ReaderTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor [N, K] as (codes int8 [N, K] in [-8, 7], scales, zeros float32 [N, K / 32])
    with `w = code · scale + zero`, read from its blocks (not from dequantized floats)."""
    n, k = (int(d) for d in reversed(t.shape))
    block_bytes = GGML_QUANT_SIZES[t.tensor_type][1]
    raw = torch.from_numpy(np.array(t.data).reshape(-1, block_bytes))  # [blocks, bytes], copied out of the mmap
    half = lambda a, b: raw[:, a:b].contiguous().view(torch.float16).float()  # noqa: E731  [blocks, (b - a) / 2]
    if t.tensor_type == Q.Q4_K:  # 256 weights: d, dmin, 12 bytes of 6-bit (sc, m) pairs, 128 bytes of nibbles
        sc, m = (torch.from_numpy(a.astype(np.float32)) for a in Q4_K.get_scale_min(raw[:, 4:16].numpy()))
        scales = half(0, 2) * sc  # [blocks, 8]
        zeros = 8 * scales - half(2, 4) * m
        qs = raw[:, 16:].reshape(-1, 4, 32)  # byte i of chunk j: weight i of group 2j (low), of 2j+1 (high)
        q = torch.stack((qs & 15, qs >> 4), dim=2)  # [blocks, 4, 2, 32]
    else:  # 32 weights: d (and Q4_1's m), 16 bytes: byte i holds weight i (low nibble) and i + 16 (high)
        offset = 2 if t.tensor_type == Q.Q4_0 else 4
        scales = half(0, 2)  # [blocks, 1]
        zeros = torch.zeros_like(scales) if t.tensor_type == Q.Q4_0 else half(2, 4) + 8 * scales
        qs = raw[:, offset:]
        q = torch.stack((qs & 15, qs >> 4), dim=1)  # [blocks, 2, 16]
    codes = q.reshape(n, k).to(torch.int8) - 8
    return codes, scales.reshape(n, k // GROUP), zeros.reshape(n, k // GROUP)


def native_linear(t: ReaderTensor, rope_heads: int | None, bias: torch.Tensor | None = None) -> nn.Module:
    """The layer a GGUF weight [N, K] runs as (the table above); `rope_heads`: undo llama.cpp's q/k row order."""
    n, k = (int(d) for d in reversed(t.shape))
    rows = (lambda x: unpermute_rope_rows(x, rope_heads)) if rope_heads else (lambda x: x)
    if t.tensor_type in FLOAT_TYPES:
        linear = nn.Linear(k, n, bias=bias is not None, device="cpu")
        with torch.no_grad():
            linear.weight.copy_(rows(dequantize_tensor(t)))
            if bias is not None:
                linear.bias.copy_(bias)
        return linear
    if t.tensor_type in INT4_TYPES and kernel_for("int4", GROUP, k, n) == "int4pack":
        codes, scales, zeros = (rows(x) for x in int4_groups(t))
        return QuantLinear(k, n, "int4", GROUP, bias).load_codes(codes, scales, zeros)
    layer = QuantLinear(k, n, "int8", k, bias)  # one scale per row: torch's int8 kernel
    return layer.load_codes(*(rows(x) for x in int8_rows(t)))


def int8_rows(t: ReaderTensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Any quantized tensor [N, K] re-quantized to int8 with one bfloat16 scale per row: (codes [N, K], scales
    [N, 1]). A few thousand rows at a time, so that a 49,152-row embedding never exists in float32 whole
    (it would, with its temporaries, take the load's peak memory to several times the model)."""
    n, k = (int(d) for d in reversed(t.shape))
    codes, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, 1, dtype=torch.bfloat16)
    for start in range(0, n, chunk):  # t.data is [rows, bytes per row]: whole rows of blocks
        floats = torch.from_numpy(np.array(dequantize(t.data[start:start + chunk], t.tensor_type)).reshape(-1, k))
        codes[start:start + chunk], scales[start:start + chunk] = quantize_weight(floats, "int8", k, torch.bfloat16)
    return codes, scales


def native_embedding(t: ReaderTensor, lm_head: nn.Module | None) -> nn.Module:
    """token_embd as int8 rows: the tied output layer's own rows where it has them, else re-quantized per row."""
    if isinstance(lm_head, QuantLinear) and lm_head.kernel == "int8pack" and lm_head.group_size:
        return QuantEmbedding.tied_to(lm_head)
    if t.tensor_type in FLOAT_TYPES:
        return nn.Embedding.from_pretrained(dequantize_tensor(t), freeze=True)
    return QuantEmbedding(*int8_rows(t))


# ---- the model --------------------------------------------------------------------------------------


def load_native_model(path: Path, config: ModelConfig) -> tuple[CausalLM, dict[str, int]]:
    """CausalLM(config) whose layers are the GGUF file's tensors as stored (the file's config and tensor
    infos were checked when its folder was made), and the file's tensor types with their counts
    ({"Q4_1": 210, "F32": 61, "Q8_0": 1}). Built on the meta device, so no float weight is allocated
    for a layer that is then replaced."""
    f = open_gguf(path)
    permuted = f.get("general.architecture") in PERMUTED_ARCHITECTURES
    tensors = {hf_tensor_name(f, t.name): t for t in f.reader.tensors}
    f.reader.fields.clear()  # gguf-py's view of every vocabulary entry (~140 MB for 49k tokens): not needed here
    with torch.device("meta"):
        model = CausalLM(config)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and f"{name}.weight" in tensors:
            bias = tensors.get(f"{name}.bias")
            layer = native_linear(tensors[f"{name}.weight"], rope_heads(config, name) if permuted else None,
                                  None if bias is None else dequantize_tensor(bias))
            model.set_submodule(name, layer)
    embed = tensors["model.embed_tokens.weight"]
    if config.tie_word_embeddings:
        model.lm_head = native_linear(embed, None)
    model.model.embed_tokens = native_embedding(embed, model.lm_head if config.tie_word_embeddings else None)
    for name, param in list(model.named_parameters()):  # what is left: the norms
        if param.is_meta:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(dequantize_tensor(tensors[name]).clone()))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "a tensor was not loaded"
    return model.eval(), dict(Counter(t.tensor_type.name for t in tensors.values()))


def rope_heads(config: ModelConfig, name: str) -> int | None:
    """llama files store q_proj / k_proj rows in llama.cpp's RoPE order: the head count to undo it with."""
    return {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name.split(".")[-1])
