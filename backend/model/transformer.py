"""A Llama-style decoder you can read top to bottom.

embedding -> N x [RMSNorm -> attention (MHA/GQA/MQA, or MLA) -> residual -> RMSNorm -> SwiGLU -> residual]
-> RMSNorm -> lm_head. Parameter names follow Hugging Face's Llama, so checkpoints load as they are.
Inputs may be [batch, seq] (training, reference) or a flat [num_tokens] (the engine's batches):
every layer works on the trailing dimensions only, and the attention backend handles the rest.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvscope.backend.config import ModelConfig
from kvscope.backend.errors import ModelLoadError
from kvscope.backend.model.attention import AttentionBackend
from kvscope.backend.model.joined import Joined, project
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
        self.joined: Joined | None = None  # Q, K, V as one matmul, once joined.py laid them side by side

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        lead = x.shape[:-1]  # [..., T]
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), self.joined)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv_heads, self.head_dim)
        v = v.view(*lead, self.n_kv_heads, self.head_dim)
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
        self.joined: Joined | None = None  # gate and up as one matmul (joined.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj), self.joined)
        return self.down_proj(F.silu(gate) * up)


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
        # Drawn by CausalLM._init_weights: nn.Embedding's own draw would be a second one, and on the meta
        # device (gguf_weights.py) it imports torch._dynamo (70 MB, a second).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
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
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.is_meta:
            return  # a shape only (gguf_weights.py builds on the meta device); nn.init there imports torch._dynamo
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
        return self.model.norm.weight.device  # a plain parameter: a quantized lm_head's `.weight` dequantizes


def num_parameters(config: ModelConfig) -> int:
    """Parameter count of a model of this shape, counting tied embeddings once."""
    return sum(math.prod(shape) for shape in parameter_shapes(config).values())


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter CausalLM(config) has, name -> shape, without building it (a tied lm_head is the
    embedding's): weights on disk are checked against these before anything is allocated. Not built on
    the meta device, whose random init first imports torch._dynamo (seconds). tests/test_hostile_files.py
    holds these equal to a built model's for every attention variant."""
    hidden, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             **_attention_shapes(config), **_linear_shapes("mlp.gate_proj", hidden, inter, config.mlp_bias),
             **_linear_shapes("mlp.up_proj", hidden, inter, config.mlp_bias),
             **_linear_shapes("mlp.down_proj", inter, hidden, config.mlp_bias)}
    shapes = {"model.embed_tokens.weight": (v, hidden)}
    for i in range(config.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, hidden)
    return shapes


def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, heads, m = config.hidden_size, config.num_attention_heads, config.mla
    if m is not None:  # mla.py: MLAttention
        return {**_linear_shapes("self_attn.q_proj", hidden, heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)),
                **_linear_shapes("self_attn.kv_a_proj_with_mqa", hidden, m.kv_lora_rank + m.qk_rope_head_dim),
                "self_attn.kv_a_layernorm.weight": (m.kv_lora_rank,),
                **_linear_shapes("self_attn.kv_b_proj", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                **_linear_shapes("self_attn.o_proj", heads * m.v_head_dim, hidden)}
    q, kv, bias = heads * config.head_dim, config.num_key_value_heads * config.head_dim, config.qkv_bias
    return {**_linear_shapes("self_attn.q_proj", hidden, q, bias), **_linear_shapes("self_attn.k_proj", hidden, kv, bias),
            **_linear_shapes("self_attn.v_proj", hidden, kv, bias),
            **_linear_shapes("self_attn.o_proj", q, hidden, config.o_bias)}


def _linear_shapes(name: str, fan_in: int, fan_out: int, bias: bool = False) -> dict[str, tuple[int, ...]]:
    """nn.Linear(fan_in, fan_out)'s parameters: weight [out, in], and bias [out]."""
    return {f"{name}.weight": (fan_out, fan_in), **({f"{name}.bias": (fan_out,)} if bias else {})}


def check_weights(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: Path,
                  implied_by: str = "config.json") -> None:
    """The tensors on disk are exactly the ones the config implies, names and shapes: checked before the
    model is built, which sizes itself from the config alone."""
    expected = parameter_shapes(config)
    found = {k: v for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")
             and not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(str(where), f"missing tensor {missing[0]} ({len(missing)} missing in all)")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelLoadError(str(where), f"unexpected tensor {unexpected[0]} for this {implied_by}")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ModelLoadError(str(where), f"tensor {name} has shape {list(found[name])}, "
                                             f"{implied_by} implies {list(shape)}")
