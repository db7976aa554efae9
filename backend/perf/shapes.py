"""Models without weights: the sizes the cost model needs, as a ModelConfig plus an optional MoE part.

A shape is a real kvscope `ModelConfig` (so the KV formula of backend/engine/kv_cache.py applies to
it unchanged) with no tensors behind it. The named shapes copy the sizes of the public Hugging Face
`config.json` files; `shape_from_config` wraps a loaded model's config, so real runs can be modelled.
Norms, biases and rotary tables are left out: under 0.1% of any of these models' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.backend.config import MLAConfig, ModelConfig
from kvscope.backend.perf.errors import unknown_name


@dataclass(frozen=True)
class Linear:
    """One weight matrix, in_features -> out_features."""

    name: str
    in_features: int
    out_features: int
    replicated: bool = False  # tensor parallelism keeps it whole on every rank (too small to split)

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class MoEShape:
    """DeepSeek-style mixture of experts: shared experts always run, `experts_per_token` routed ones."""

    num_routed_experts: int
    experts_per_token: int
    num_shared_experts: int
    expert_intermediate_size: int
    first_dense_layers: int  # layers [0, first_dense_layers) keep the dense MLP


@dataclass(frozen=True)
class ModelShape:
    name: str
    config: ModelConfig
    moe: MoEShape | None = None
    note: str = ""

    @property
    def dtype(self) -> str:
        """The weights' and activations' dtype when not quantized."""
        return self.config.torch_dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - self.moe.first_dense_layers

    def attention_linears(self) -> list[Linear]:
        """One layer's attention projections (MLA: q, the latent down-projection, kv_b, o)."""
        c, h = self.config, self.config.hidden_size
        if c.mla is None:
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [Linear("q_proj", h, q), Linear("k_proj", h, kv), Linear("v_proj", h, kv), Linear("o_proj", q, h)]
        m, heads = c.mla, c.num_attention_heads
        return [Linear("q_proj", h, heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)),
                Linear("kv_a_proj_with_mqa", h, m.kv_lora_rank + m.qk_rope_head_dim, replicated=True),
                Linear("kv_b_proj", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim)),
                Linear("o_proj", heads * m.v_head_dim, h)]

    def dense_mlp_linears(self) -> list[Linear]:
        """One dense layer's SwiGLU MLP."""
        return swiglu(self.config.hidden_size, self.config.intermediate_size)

    def expert_linears(self) -> list[Linear]:
        """One expert's SwiGLU MLP (shared and routed experts have the same size)."""
        assert self.moe is not None
        return swiglu(self.config.hidden_size, self.moe.expert_intermediate_size)

    def router(self) -> Linear:
        assert self.moe is not None
        return Linear("gate", self.config.hidden_size, self.moe.num_routed_experts, replicated=True)

    def lm_head(self) -> Linear:
        return Linear("lm_head", self.config.hidden_size, self.config.vocab_size)

    def num_parameters(self, active_only: bool = False) -> int:
        """Weights as the cost model counts them (tied embeddings once); active_only: what one token uses."""
        c = self.config
        total = self.num_layers * params(self.attention_linears())
        total += (self.num_layers - self.num_moe_layers) * params(self.dense_mlp_linears())
        if self.moe is not None:
            experts = self.moe.num_shared_experts + (self.moe.experts_per_token if active_only
                                                     else self.moe.num_routed_experts)
            total += self.num_moe_layers * (experts * params(self.expert_linears()) + self.router().params)
        embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return total + embedding + self.lm_head().params


def params(linears: list[Linear]) -> int:
    return sum(w.params for w in linears)


def swiglu(hidden: int, inter: int) -> list[Linear]:
    return [Linear("gate_proj", hidden, inter), Linear("up_proj", hidden, inter), Linear("down_proj", inter, hidden)]


# ---- the named shapes (sizes from each model's Hugging Face config.json) ----------------------------

def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, **extra) -> ModelConfig:
    extra.setdefault("architecture", "LlamaForCausalLM")
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=extra.pop("head_dim", hidden // heads), torch_dtype="bfloat16", **extra)


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-3-8b", _llama(128256, 4096, 14336, 32, 32, 8, max_position_embeddings=8192,
                                    rope_theta=500000.0), note="meta-llama/Meta-Llama-3-8B"),
    ModelShape("llama-3-70b", _llama(128256, 8192, 28672, 80, 64, 8, max_position_embeddings=8192,
                                     rope_theta=500000.0), note="meta-llama/Meta-Llama-3-70B"),
    ModelShape("qwen2.5-7b", _llama(152064, 3584, 18944, 28, 28, 4, max_position_embeddings=32768,
                                    rope_theta=1000000.0, qkv_bias=True, architecture="Qwen2ForCausalLM"),
               note="Qwen/Qwen2.5-7B"),
    ModelShape("mistral-7b", _llama(32768, 4096, 14336, 32, 32, 8, max_position_embeddings=32768,
                                    rope_theta=1000000.0, architecture="MistralForCausalLM"),
               note="mistralai/Mistral-7B-v0.3"),
    ModelShape("deepseek-v2-lite",
               ModelConfig(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                           num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                           max_position_embeddings=163840, torch_dtype="bfloat16",
                           mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                         v_head_dim=128)),
               moe=MoEShape(num_routed_experts=64, experts_per_token=6, num_shared_experts=2,
                            expert_intermediate_size=1408, first_dense_layers=1),
               note="deepseek-ai/DeepSeek-V2-Lite: MLA without query compression; 15.7B weights, 2.7B per token"),
    ModelShape("smollm2-135m", _llama(49152, 576, 1536, 30, 9, 3, max_position_embeddings=8192,
                                      rope_theta=100000.0, tie_word_embeddings=True),
               note="HuggingFaceTB/SmolLM2-135M"),
)}


def get_shape(name: str) -> ModelShape:
    """A named shape; an unknown name raises a PerfError listing the valid ones."""
    if name not in SHAPES:
        raise unknown_name("model_shape", name, sorted(SHAPES))
    return SHAPES[name]


def shape_from_config(config: ModelConfig, name: str = "loaded") -> ModelShape:
    """The shape of a loaded kvscope model (its config.json), so a real run can be modelled."""
    return ModelShape(name, config)
