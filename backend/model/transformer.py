"""A Llama-style decoder you can read top to bottom.

embedding -> N x [RMSNorm -> attention (MHA/GQA/MQA, or MLA) -> residual -> RMSNorm -> SwiGLU -> residual]
-> RMSNorm -> lm_head. Parameter names follow Hugging Face's Llama, so checkpoints load as they are.
Inputs may be [batch, seq] (training, reference) or a flat [num_tokens] (the engine's batches):
every layer works on the trailing dimensions only, and the attention backend handles the rest.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvscope.backend.config import ModelConfig
from kvscope.backend.model.attention import AttentionBackend
from kvscope.backend.model.layers import RMSNorm, RotaryEmbedding, apply_rope
from kvscope.backend.model.mla import MLAttention


class Attention(nn.Module):
    """Multi-head attention with n_kv_heads <= n_heads: MHA (equal), GQA (a divisor), MQA (one)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.qkv_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        lead = x.shape[:-1]  # [..., T]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn.attend(self.layer, q, k, v, self.head_dim**-0.5)  # [..., T, n_heads, head_dim]
        return self.o_proj(out.reshape(*lead, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer) if config.mla else Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rope_dim = config.mla.qk_rope_head_dim if config.mla else config.head_dim
        self.rotary = RotaryEmbedding(rope_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [..., T, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class CausalLM(nn.Module):
    """The reference decoder-only language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small normal init (std 0.02, as Llama's initializer_range): PyTorch's default N(0, 1)
        # embedding, tied to the output, would start the loss near 100 instead of ln(vocab).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states [..., T, hidden] after the final norm; `logits()` projects the ones you need."""
        return self.model(input_ids, positions, attn)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [..., vocab]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def num_parameters(config: ModelConfig) -> int:
    """Parameter count of a model of this shape, counting tied embeddings once (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(config).parameters())
