"""The reference decoder: attention variants and their invariants."""

import pytest
import torch

from kvscope.backend.config import MLAConfig, ModelConfig
from kvscope.backend.model.attention import DenseCausalBackend, causal_attention
from kvscope.backend.model.transformer import CausalLM


def tiny(n_kv_heads: int = 2, mla: MLAConfig | None = None) -> CausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=n_kv_heads, head_dim=8, mla=mla)
    return CausalLM(cfg).eval()


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_kv_projections_have_n_kv_heads(n_kv_heads):
    attn = tiny(n_kv_heads).model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (n_kv_heads * 8, 32)
    assert attn.q_proj.weight.shape == (4 * 8, 32)


def test_mla_absorbed_form_equals_expanded_form():
    model = tiny(4, MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8))
    ids = torch.randint(0, 64, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        expanded = model(ids, pos, DenseCausalBackend(absorb_mla=False))
        absorbed = model(ids, pos, DenseCausalBackend(absorb_mla=True))
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_causal_attention_with_offset_matches_the_tail_of_full_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    full = DenseCausalBackend().attend(0, q, k, v, 8**-0.5)
    # the last 3 queries (a chunk, or a decode of 3 verify rows) against all 10 keys
    tail = causal_attention(q[7:], k, v, 8**-0.5, q_offset=7)
    torch.testing.assert_close(tail, full[7:], atol=1e-5, rtol=1e-5)


def test_flat_token_input_equals_batched_rows():
    model = tiny()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        batched = model(ids, torch.arange(9)[None], DenseCausalBackend())[0]
        flat = model(ids[0], torch.arange(9), DenseCausalBackend())
    torch.testing.assert_close(flat, batched)
