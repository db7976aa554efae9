"""Model configuration: one pydantic model read from and written to a Hugging Face `config.json`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AttentionKind = Literal["mha", "gqa", "mqa", "mla"]

# Architectures whose config.json we read as Llama-style decoders; the difference between them is
# only which optional biases exist (Qwen2: q/k/v bias) and a few defaults.
HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
KVSCOPE_ARCHITECTURE = "KvscopeForCausalLM"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
KV_SCALE_BYTES = 4  # an int8 cache keeps one float32 scale per row it stores (kernels/cache_write.py)
KVCacheDtype = Literal["auto", "float16", "bfloat16", "int8"]  # vLLM's --kv-cache-dtype names, where they exist
KV_CACHE_DTYPES: tuple[str, ...] = KVCacheDtype.__args__


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype a KV cache stores: the model's own for "auto", else the one named."""
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def kv_bytes_per_token(n_layers: int, rows_per_layer: int, row_values: int, bytes_per_value: int,
                       scales: bool = False) -> int:
    """The KV formula, its one definition: per layer a token stores `rows_per_layer` rows of
    `row_values` numbers (a key and a value per KV head, 2·N_kv rows of D_h; MLA one row, the latent
    and the RoPE key), each number `bytes_per_value` bytes, plus an int8 cache's scale per row.
    So 2·L·N_kv·D_h·bytes, MLA L·(kv_lora_rank + qk_rope_head_dim)·bytes."""
    return n_layers * rows_per_layer * (row_values * bytes_per_value + (KV_SCALE_BYTES if scales else 0))


class RopeScaling(BaseModel):
    """Llama 3 style frequency scaling; `rope_type: default` means none."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = Field(default=1.0, gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, gt=0)

    @model_validator(mode="after")
    def _factors_apart(self) -> "RopeScaling":
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:  # they divide their difference
            raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must be above low_freq_factor "
                             f"({self.low_freq_factor})")
        return self


# Ceilings of a model's shape: far above any published model's, and low enough that a config.json's
# numbers alone (a vocabulary of 1e12) never size an allocation; the weights must match them too
# (transformer.check_weights, before a model is built).
MAX_VOCAB = 1 << 22
MAX_HIDDEN = 1 << 17
MAX_INTERMEDIATE = 1 << 20
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_POSITIONS = 1 << 24


class MLAConfig(BaseModel):
    """DeepSeek-V2 multi-head latent attention sizes."""

    kv_lora_rank: int = Field(gt=0, le=MAX_HIDDEN)
    qk_nope_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    qk_rope_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    v_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)


class ModelConfig(BaseModel):
    """Everything the reference decoder needs to build itself."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    architecture: str = KVSCOPE_ARCHITECTURE
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    hidden_size: int = Field(gt=0, le=MAX_HIDDEN)
    intermediate_size: int = Field(gt=0, le=MAX_INTERMEDIATE)
    num_hidden_layers: int = Field(gt=0, le=MAX_LAYERS)
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS)
    num_key_value_heads: int = Field(gt=0, le=MAX_HEADS)
    head_dim: int = Field(gt=0, le=MAX_HEAD_DIM, description="absent: hidden_size / num_attention_heads")
    max_position_embeddings: int = Field(default=2048, gt=0, le=MAX_POSITIONS)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    mla: MLAConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"

    @model_validator(mode="before")
    @classmethod
    def _derived_head_dim(cls, data: Any) -> Any:
        """Without head_dim (Hugging Face leaves it out) a head is hidden_size / num_attention_heads, which must divide."""
        if not isinstance(data, dict) or data.get("head_dim") is not None:
            return data
        hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
        if type(hidden) is not int or type(heads) is not int or heads <= 0:
            return {k: v for k, v in data.items() if k != "head_dim"}  # the field checks name what is wrong
        if hidden % heads:
            raise ValueError(f"head_dim: not given, and hidden_size ({hidden}) is not a multiple of "
                             f"num_attention_heads ({heads})")
        return {**data, "head_dim": hidden // heads}

    @model_validator(mode="after")
    def _shapes_fit(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        rotary = self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim
        if rotary % 2:  # RoPE rotates pairs of numbers
            raise ValueError(f"{'mla.qk_rope_head_dim' if self.mla else 'head_dim'} ({rotary}) must be even (RoPE)")
        for name, token in (("bos_token_id", self.bos_token_id), *(("eos_token_id", t) for t in self.eos_token_ids)):
            if token is not None and not 0 <= token < self.vocab_size:
                raise ValueError(f"{name}: {token} is not a token of the vocabulary (0..{self.vocab_size - 1})")
        return self

    @property
    def attention(self) -> AttentionKind:
        """Which attention variant the head counts describe."""
        if self.mla is not None:
            return "mla"
        if self.num_key_value_heads == self.num_attention_heads:
            return "mha"
        if self.num_key_value_heads == 1:
            return "mqa"
        return "gqa"

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def kv_rows_per_layer(self) -> tuple[int, int]:
        """The rows the cache stores for one token in one layer, and the numbers in a row: a key and a
        value per KV head, or MLA's one row of latent and RoPE key."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_key_value_heads, self.head_dim

    def kv_bytes_per_token(self, dtype: str = "float16") -> int:
        """Cache bytes per token in `dtype`, an int8 cache's scales included (the module's KV formula)."""
        rows, values = self.kv_rows_per_layer()
        return kv_bytes_per_token(self.num_hidden_layers, rows, values, DTYPE_BYTES[dtype], scales=dtype == "int8")

    # ---- Hugging Face config.json <-> ModelConfig -------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Any) -> "ModelConfig":
        """Read a Hugging Face style config.json dict (Llama, Qwen2, Mistral or kvscope's own).

        Strictly typed: "256" or true is not a size, 6.5 is not a layer count (pydantic's usual
        coercion would take them). Raises KeyError for a missing field, ValueError for the rest."""
        if not isinstance(d, dict):
            raise ValueError(f"a config is a JSON object, not {type(d).__name__}")
        archs = d.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
        if arch not in HF_ARCHITECTURES + (KVSCOPE_ARCHITECTURE,):
            known = ", ".join(HF_ARCHITECTURES + (KVSCOPE_ARCHITECTURE,))
            raise ValueError(f"architectures: unsupported architecture {arch or '(none)'!r}; known: {known}")
        scaling = d.get("rope_scaling") or d.get("rope_parameters")  # transformers 5 writes rope_parameters
        if scaling is not None and not isinstance(scaling, dict):
            raise ValueError("rope_scaling: an object ({rope_type, factor, ...}) or null")
        attn_bias = _flag(d, "attention_bias")
        n_heads = d["num_attention_heads"]
        return cls.model_validate({
            "architecture": arch,
            "vocab_size": d["vocab_size"],
            "hidden_size": d["hidden_size"],
            "intermediate_size": d["intermediate_size"],
            "num_hidden_layers": d["num_hidden_layers"],
            "num_attention_heads": n_heads,
            "num_key_value_heads": _given(d, "num_key_value_heads", n_heads),
            "head_dim": d.get("head_dim"),  # None: derived from hidden_size
            "max_position_embeddings": _given(d, "max_position_embeddings", 2048),
            "rope_theta": d.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0,
            "rope_scaling": scaling if scaling and scaling.get("rope_type", "default") != "default" else None,
            "rms_norm_eps": _given(d, "rms_norm_eps", 1e-6),
            "tie_word_embeddings": _given(d, "tie_word_embeddings", False),
            "qkv_bias": attn_bias or arch == "Qwen2ForCausalLM",
            "o_bias": attn_bias,
            "mlp_bias": _flag(d, "mlp_bias"),
            "mla": d.get("mla") or None,
            "bos_token_id": d.get("bos_token_id"),
            "eos_token_id": d.get("eos_token_id"),
            "torch_dtype": d.get("torch_dtype") or d.get("dtype") or "float32",
        }, strict=True)

    def to_hf_dict(self) -> dict:
        """The config.json that transformers reads (Llama form) or kvscope's own form (MLA)."""
        d = {
            "architectures": [self.architecture],
            "model_type": "llama" if self.architecture == "LlamaForCausalLM" else "kvscope",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.mla is not None:
            d["mla"] = self.mla.model_dump()
        return d


def _given(d: dict, key: str, default: Any) -> Any:
    """d[key], or the default when it is absent or null (Hugging Face writes both)."""
    value = d.get(key)
    return default if value is None else value


def _flag(d: dict, key: str) -> bool:
    value = _given(d, key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: {value!r} is not true or false")
    return value


# ---- Engine configuration -----------------------------------------------------------------------

# The engine's own ceilings, also what a trace read from anywhere may claim (backend/events/bounds.py):
# the reducer and every picture size a pool and its block tables from them.
MAX_BLOCK_SIZE = 256
MAX_NUM_BLOCKS = 1_000_000
MAX_MODEL_LEN = 1_000_000


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["draft", "ngram"] = "draft"
    draft_model: str = "demo-draft"
    num_tokens: int = Field(default=4, ge=1, le=16)


class DisaggregationConfig(BaseModel):
    """Prefill and decode on instances of their own (docs/engine.md#disaggregated-prefill-and-decode)."""

    model_config = ConfigDict(extra="forbid")
    prefill_instances: int = Field(default=1, ge=1, le=8, description="instances that run prompts only")
    decode_instances: int = Field(default=1, ge=1, le=8, description="instances that run decodes only")
    router: Literal["round_robin", "least_loaded"] = Field(
        default="round_robin", description="how a new request picks its prefill instance, and a prefilled "
                                           "one its decode instance")


class EngineConfig(BaseModel):
    """Every knob of the engine; a scenario's `engine:` section. Unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    block_size: int = Field(default=16, ge=1, le=MAX_BLOCK_SIZE, description="tokens per KV block")
    num_blocks: int | None = Field(default=256, ge=1, le=MAX_NUM_BLOCKS,
                                   description="KV blocks; null = derive from kv_cache_memory_mb")
    # Unbounded here: a server's KV limits refuse an oversized budget naming themselves (limits.py).
    kv_cache_memory_mb: float = Field(default=64.0, gt=0, description="budget used when num_blocks is null")
    max_num_seqs: int = Field(default=8, ge=1, le=1024, description="sequences running at once")
    max_num_batched_tokens: int = Field(default=256, ge=1, le=65536, description="token budget per iteration")
    batching: Literal["continuous", "static"] = "continuous"
    kv_layout: Literal["paged", "contiguous"] = "paged"
    kv_cache: bool = Field(default=True, description="false: recompute the whole prefix every step")
    prefix_caching: bool = True
    chunked_prefill: bool = True
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    max_model_len: int = Field(default=1024, ge=2, le=MAX_MODEL_LEN, description="prompt + output limit")
    events: Literal["full", "summary", "off"] = "full"
    dist_top_n: int = Field(default=10, ge=1, le=100, description="tokens kept in each token event's dist")
    speculative: SpeculativeConfig | None = None
    weights: Literal["native", "float32"] = Field(
        default="native", description="a GGUF model's weights: native runs them as the file stores them (Q4 "
                                      "blocks through torch's int4 kernel); float32 de-quantizes them at load. "
                                      "Other models load as stored either way")
    weight_quant: Literal["none", "int8", "int4"] = "none"
    quant_group_size: int = Field(default=64, ge=0, le=4096,
                                  description="weights sharing one quantization scale along the input dimension; "
                                              "0 = one scale per tensor (the baseline); must divide every "
                                              "linear layer's input size")
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto", description="what the KV cache stores: auto = the model's dtype; float16 or bfloat16 halve a "
                                    "float32 model's cache (the values rounded once, as written); int8 = codes and a "
                                    "float32 scale per token and KV head")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tensor_parallel: int = Field(default=1, ge=1, le=64,
                                 description="ranks (processes) the model is sharded over: it must divide the "
                                             "attention heads and the MLP's size (docs/engine.md#tensor-parallelism); "
                                             "kv_cache_memory_mb is then each rank's")
    compile_decode: bool = Field(default=False,
                                 description="run decode-only steps through one torch.compile'd graph of the whole "
                                             "model (attention_backend torch, one rank): fewer, fused ops per step "
                                             "for a compile paid once per process (docs/engine.md#compiled-decode)")
    batch_invariant: bool = Field(default=False,
                                  description="a request's tokens and log-probabilities never depend on what else is "
                                              "in the batch or the cache: each query token is a forward of its own "
                                              "(one-row kernels), at a cost in throughput "
                                              "(docs/engine.md#batch-invariant-mode)")
    disaggregation: DisaggregationConfig | None = Field(
        default=None, description="prefill and decode on separate instances, each with its own KV cache and "
                                  "scheduler, the prompt's blocks sent from one to the other over torch.distributed; "
                                  "num_blocks is then each instance's")
    tensor_parallel_timeout_s: float = Field(default=60.0, gt=0, le=3600,
                                             description="how long a collective waits for a rank before the run "
                                                         "fails naming it")
