"""The KV-cache size formula of the seeds: 2 · L · N_kv · D_h · bytes per token."""

from kvscope.backend.config import MLAConfig, ModelConfig

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
