"""The KV cache tensors: preallocated once, addressed by (block id, offset in block).

Per layer, K and V are [num_blocks, block_size, n_kv_heads, head_dim]. MLA stores one tensor per
layer, [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]: the latent followed by the
RoPE key, whose first kv_lora_rank numbers double as the value.
"""

from __future__ import annotations

import torch

from backend.config import ModelConfig

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.latent_dim = config.mla.kv_lora_rank if config.mla else None
        if config.mla:
            heads, dim, planes = 1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim, 1
        else:
            heads, dim, planes = config.num_key_value_heads, config.head_dim, 2
        # [layers, K/V planes, num_blocks, block_size, n_kv_heads, head_dim]
        self.data = torch.zeros(config.num_hidden_layers, planes, num_blocks, block_size, heads, dim,
                                dtype=dtype, device=device)
        self.bytes_per_block = config.kv_bytes_per_token(DTYPE_NAMES[dtype]) * block_size

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]  # [num_blocks, block_size, n_kv_heads, head_dim]

    def values(self, layer: int) -> torch.Tensor:
        if self.latent_dim is not None:
            return self.data[layer, 0, ..., : self.latent_dim]  # MLA: the latent part of the key
        return self.data[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [num_tokens, n_kv_heads, dim] at flat slot indices [num_tokens]."""
        flat = self.data[layer].flatten(1, 2)  # [planes, num_blocks * block_size, heads, dim]
        flat[0, slots] = k.to(self.dtype)
        if self.latent_dim is None:
            flat[1, slots] = v.to(self.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer, K and V)."""
        for src, dst in pairs:
            self.data[:, :, dst] = self.data[:, :, src]


def num_blocks_for_budget(config: ModelConfig, block_size: int, memory_mb: float, dtype: str) -> int:
    """How many blocks fit a memory budget, by the KV formula."""
    return max(1, int(memory_mb * 1024**2 // (config.kv_bytes_per_token(dtype) * block_size)))
