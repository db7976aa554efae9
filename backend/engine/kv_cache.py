"""The KV cache tensors: preallocated once, addressed by (block id, offset in block).

Per layer, K and V are [num_blocks, block_size, n_kv_heads, head_dim]. MLA stores one tensor per
layer, [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]: the latent followed by the
RoPE key, whose first kv_lora_rank numbers double as the value.

int8 (`kv_dtype="int8"`): the same tensors hold int8 codes, and float32 scales live beside the
blocks, [num_blocks, block_size, n_kv_heads] per layer and plane: one scale per (token, KV head)
row, `scale = max|row| / 127`, exactly the layout and rounding of kernels/cache_write.py. `write`
quantizes, the torch readers (`gather_keys`, `gather_values`) dequantize, and the Triton kernels
take the scales as k_scale/v_scale. MLA's value is a view of the key row, so it shares the key's scale.

float16 / bfloat16 (`kv_dtype="float16"`, ...) under a float32 model: the values are rounded once, as
written, and read back in the model's dtype: half the bytes of a float32 cache (llama.cpp's default
K/V is float16), no scales.
"""

from __future__ import annotations

import torch

from kvscope.backend.config import DTYPE_BYTES, ModelConfig, kv_bytes_per_token, kv_storage_dtype

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8"}
INT8_MAX = 127.0


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scales [...]): one symmetric scale per row.

    The same arithmetic as kernels/cache_write.quantize_int8_reference (not imported: importing
    kernels/ imports triton, which a CPU machine only loads under TRITON_INTERPRET=1).
    """
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(x / safe[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def kv_dtype_name(kv_dtype: str, dtype: torch.dtype) -> str:
    """The dtype a cache of a `dtype` model stores: the model's own ("auto"), or the one named."""
    return kv_storage_dtype(kv_dtype, DTYPE_NAMES[dtype])


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, kv_dtype: str = "auto") -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype  # the model's dtype: what readers return
        self.quantized = kv_dtype == "int8"
        self.storage_dtype = getattr(torch, kv_dtype_name(kv_dtype, dtype))
        self.latent_dim = config.mla.kv_lora_rank if config.mla else None
        if config.mla:
            heads, dim, planes = 1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim, 1
        else:
            heads, dim, planes = config.num_key_value_heads, config.head_dim, 2
        # [layers, K/V planes, num_blocks, block_size, n_kv_heads, head_dim]
        self.data = torch.zeros(config.num_hidden_layers, planes, num_blocks, block_size, heads, dim,
                                dtype=self.storage_dtype, device=device)
        # [layers, K/V planes, num_blocks, block_size, n_kv_heads] float32, int8 only
        self.scales = (torch.zeros(self.data.shape[:-1], dtype=torch.float32, device=device)
                       if self.quantized else None)
        self.bytes_per_token = config.kv_bytes_per_token(DTYPE_NAMES[self.storage_dtype])
        self.index = torch.arange(max(config.num_hidden_layers, planes), device=device)  # layer and plane ids
        self.bytes_per_block = self.bytes_per_token * block_size

    # ---- raw storage (the Triton kernels read it as it is) ----------------------------------------

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [num_blocks, block_size, n_kv_heads, head_dim]

    def values(self, layer: int) -> torch.Tensor:
        if self.latent_dim is not None:
            return self.data[layer, 0, ..., : self.latent_dim]  # MLA: the latent part of the key
        return self.data[layer, 1]

    def key_scales(self, layer: int) -> torch.Tensor | None:
        """[num_blocks, block_size, n_kv_heads] float32, or None when not int8."""
        return None if self.scales is None else self.scales[layer, 0]

    def value_scales(self, layer: int) -> torch.Tensor | None:
        if self.scales is None:
            return None
        return self.scales[layer, 0 if self.latent_dim is not None else 1]  # MLA: the key row's scale

    # ---- dequantized reads (the torch attention path) ---------------------------------------------

    def gather_keys(self, layer: int, blocks: torch.Tensor | list[int]) -> torch.Tensor:
        """Keys of the given blocks in the model dtype: blocks [...] -> [..., block_size, n_kv_heads, D]."""
        return self._gather(self.keys(layer), self.key_scales(layer), blocks)

    def gather_values(self, layer: int, blocks: torch.Tensor | list[int]) -> torch.Tensor:
        return self._gather(self.values(layer), self.value_scales(layer), blocks)

    def _gather(self, data: torch.Tensor, scales: torch.Tensor | None, blocks) -> torch.Tensor:
        """Only the given blocks are read. int8: their codes (1 byte a value) times their scales, in one
        multiply whose type promotion writes floats directly: no float copy of the codes first, and
        never of the pool (tests/test_quant.py measures the bytes allocated)."""
        rows = data[blocks]  # [..., block_size, heads, dim]
        if scales is None:
            return rows if rows.dtype == self.dtype else rows.to(self.dtype)  # a 16-bit cache widened: these blocks
        return (rows * scales[blocks][..., None]).to(self.dtype)  # int8 * float32 -> float32

    # ---- writes -------------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [num_tokens, n_kv_heads, dim] at flat slot indices [num_tokens].

        Indexed on the pool itself rather than on a view of it: torch.compile (runner.py) turns a write
        into a view of an input into a copy of the whole pool per layer, a write into the input in place."""
        at = (slots // self.block_size, slots % self.block_size)  # [num_tokens] block, offset within it
        rows = [k] if self.latent_dim is not None else [k, v]
        for plane, x in enumerate(rows):
            where = (self.index[layer], self.index[plane], *at)
            if self.scales is None:
                self.data.index_put_(where, x.to(self.storage_dtype))
            else:
                codes, scale = quantize_rows_int8(x)
                self.data.index_put_(where, codes)
                self.scales.index_put_(where, scale)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer, K and V, and their scales)."""
        for src, dst in pairs:
            self.data[:, :, dst] = self.data[:, :, src]
            if self.scales is not None:
                self.scales[:, :, dst] = self.scales[:, :, src]


def num_blocks_for_budget(config: ModelConfig, block_size: int, memory_mb: float, dtype: str) -> int:
    """How many blocks fit a memory budget, by the KV formula (int8: scales included)."""
    return max(1, int(memory_mb * 1024**2 // (config.kv_bytes_per_token(dtype) * block_size)))


def kv_formula(config: ModelConfig, kv_dtype: str) -> dict:
    """How kv_bytes_per_token is computed, for the header (and the dashboard's KV calculator)."""
    rows, row_values = config.kv_rows_per_layer()
    bytes_per_value = DTYPE_BYTES[kv_dtype]
    scale_bytes = config.kv_bytes_per_token(kv_dtype) - kv_bytes_per_token(config.num_hidden_layers, rows, row_values,
                                                                            bytes_per_value)
    if config.mla is None:
        text = "2 x L x N_kv x (D_h x 1 + 4 scale) bytes" if scale_bytes else "2 x L x N_kv x D_h x bytes"
    else:
        text = ("L x ((kv_lora_rank + qk_rope_head_dim) x 1 + 4 scale) bytes" if scale_bytes
                else "L x (kv_lora_rank + qk_rope_head_dim) x bytes")
    return {"n_layers": config.num_hidden_layers, "values_per_token_per_layer": rows * row_values,
            "bytes_per_value": bytes_per_value, "scale_bytes_per_token": scale_bytes,
            "text": text}
