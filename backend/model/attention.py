"""The seam between the model and where K/V live.

A layer computes q, k, v for the tokens it was given and hands them to an `AttentionBackend`. The
dense backend below attends within each row of a `[batch, seq]` input (training, the reference
model); the engine's paged backend writes k/v into cache blocks and attends over block tables,
without the model code knowing which one it talks to.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    # MLA layers ask this: True means "give me the latent form" (one shared key of
    # kv_lora_rank + rope dims, value = the latent), which is what a cache stores.
    absorb_mla: bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [..., T, Hq, Dk], k [..., T, Hkv, Dk], v [..., T, Hkv, Dv] -> [..., T, Hq, Dv]."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_offset: int = 0) -> torch.Tensor:
    """Plain attention where query i sits at absolute position q_offset + i and sees keys 0..that.

    q [Tq, Hq, Dk], k [Tk, Hkv, Dk], v [Tk, Hkv, Dv] -> [Tq, Hq, Dv]. The mask is built explicitly:
    SDPA's is_causal aligns to the top-left, which is wrong whenever Tq != Tk (decode, chunks).
    """
    q_pos = torch.arange(q.shape[0], device=q.device) + q_offset
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [Tq, Tk]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)  # [Tq, Hq, Dv]


class DenseCausalBackend:
    """Attention within each row of a [batch, seq] input, no cache: training and the reference model."""

    def __init__(self, absorb_mla: bool = False) -> None:
        self.absorb_mla = absorb_mla

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # [..., T, H, D] -> [..., H, T, D] for SDPA; here query and key lengths are equal.
        out = F.scaled_dot_product_attention(
            q.transpose(-3, -2),
            k.transpose(-3, -2),
            v.transpose(-3, -2),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[-2] != k.shape[-2],
        )
        return out.transpose(-3, -2)
