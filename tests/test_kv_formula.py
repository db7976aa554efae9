"""The KV-cache size formula of the seeds: 2 · L · N_kv · D_h · bytes per token."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.backend.config import DTYPE_BYTES, MLAConfig, ModelConfig

MIB = 1024**2


def llama_like(n_kv_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=n_kv_heads, head_dim=128)


def test_gqa_with_8_kv_heads_needs_512_mib_for_4096_tokens_in_fp16():
    assert llama_like(8).kv_bytes_per_token("float16") * 4096 == 512 * MIB


def test_mha_with_32_kv_heads_needs_four_times_as_much():
    assert llama_like(32).kv_bytes_per_token("float16") * 4096 == 2048 * MIB


def test_attention_variant_follows_the_head_counts():
    assert [llama_like(n).attention for n in (32, 8, 1)] == ["mha", "gqa", "mqa"]


def test_mla_stores_latent_plus_rope_key_per_token():
    cfg = llama_like(32).model_copy(update={"mla": MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128,
                                                             qk_rope_head_dim=64, v_head_dim=128)})
    assert cfg.attention == "mla"
    assert cfg.kv_bytes_per_token("float16") == 32 * (512 + 64) * 2


def test_an_int8_cache_costs_its_scales_whoever_asks():
    """One formula: the config, the cache the engine allocates and the dashboard's calculator agree,
    an int8 cache's float32 scale per row included (2 · L · N_kv · (D_h · 1 + 4))."""
    import torch

    from kvscope.backend.engine.kv_cache import KVCache
    from kvscope.frontend.views.kv_calc import KvInputs, bytes_per_token

    cfg = llama_like(8)
    cache = KVCache(cfg, num_blocks=1, block_size=1, dtype=torch.float16, device=torch.device("cpu"), kv_dtype="int8")
    calculator = KvInputs(variant="gqa", n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, bytes_per_value=1,
                          scales=True)
    assert cfg.kv_bytes_per_token("int8") == cache.bytes_per_token == bytes_per_token(calculator) == 2 * 32 * 8 * 132


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 64), kv_heads=st.sampled_from([1, 2, 4, 8, 16]), head_dim=st.sampled_from([16, 64, 128]),
       mla=st.booleans(), dtype=st.sampled_from(["float32", "float16", "bfloat16", "int8"]))
def test_the_calculator_is_the_configs_formula(layers, kv_heads, head_dim, mla, dtype):
    from kvscope.frontend.views.kv_calc import KvInputs, bytes_per_token

    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=kv_heads, head_dim=head_dim,
                      mla=MLAConfig(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32) if mla
                      else None)
    inputs = KvInputs(variant="mla" if mla else "gqa", n_layers=layers, n_heads=16, n_kv_heads=kv_heads,
                      head_dim=head_dim, latent=64 + 16, bytes_per_value=DTYPE_BYTES[dtype], scales=dtype == "int8")
    assert bytes_per_token(inputs) == cfg.kv_bytes_per_token(dtype)
