"""Multi-head latent attention in the DeepSeek-V2 form.

Keys and values are not cached per head: each token stores one latent c_kv (kv_lora_rank numbers)
and one decoupled RoPE key (qk_rope_head_dim numbers) shared by all heads. Per-head keys and values
are up-projections of the latent (kv_b_proj). Because those projections are linear, they can be
absorbed: fold W_UK into the query and W_UV into the output, and attention runs directly over the
latent cache as if it were multi-query attention with one wide head. That is what a cache-backed
backend asks for (`attn.absorb_mla`); training uses the plain, expanded form. Both give the same
numbers (tests/test_model.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kvscope.backend.config import ModelConfig
from kvscope.backend.model.attention import AttentionBackend
from kvscope.backend.model.layers import RMSNorm, apply_rope


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        assert config.mla is not None
        m = config.mla
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.rank, self.nope, self.rope, self.v_dim = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, hidden, bias=False)
        # The softmax scale belongs to the per-head key width, in both forms.
        self.scale = (self.nope + self.rope) ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        lead = x.shape[:-1]  # [..., T]
        q = self.q_proj(x).view(*lead, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [..., T, rank]
        k_rope = apply_rope(k_rope.unsqueeze(-2), cos, sin)  # [..., T, 1, rope]
        run = self._absorbed if attn.absorb_mla else self._expanded
        out = run(q_nope, q_rope, c_kv, k_rope, attn)  # [..., T, n_heads, v_dim]
        return self.o_proj(out.reshape(*lead, -1))

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v_dim, rank], views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _expanded(self, q_nope, q_rope, c_kv, k_rope, attn: AttentionBackend) -> torch.Tensor:
        kv = self.kv_b_proj(c_kv).view(*c_kv.shape[:-1], self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(*k_nope.shape[:-1], self.rope)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return attn.attend(self.layer, q, k, v, self.scale)

    def _absorbed(self, q_nope, q_rope, c_kv, k_rope, attn: AttentionBackend) -> torch.Tensor:
        w_uk, w_uv = self._up_weights()
        q_latent = torch.einsum("...hn,hnr->...hr", q_nope, w_uk)  # [..., T, H, rank]
        q = torch.cat((q_latent, q_rope), dim=-1)  # [..., T, H, rank + rope]
        # One shared "KV head": key = [latent | rope key], value = the latent itself. The cache keeps
        # only the key; its first `rank` numbers are the value.
        k = torch.cat((c_kv.unsqueeze(-2), k_rope), dim=-1)  # [..., T, 1, rank + rope]
        out_latent = attn.attend(self.layer, q, k, k[..., : self.rank], self.scale)  # [..., T, H, rank]
        return torch.einsum("...hr,hvr->...hv", out_latent, w_uv)
