"""Local Hugging Face checkpoints load in kvscope and compute what transformers computes.

Tiny random models are built with transformers itself (no download), saved as sharded safetensors
folders, loaded by kvscope and compared: logits within 1e-4 in fp32 and 32 identical greedy tokens.
"""

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvscope.backend.engine.sampling_params import SamplingParams  # noqa: E402
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, load_model  # noqa: E402
from kvscope.backend.engine.reference import next_token_logits, reference_generate  # noqa: E402

TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, tie_word_embeddings=False)
CASES = {
    "llama-gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "llama-mqa-llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_key_value_heads=1, rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))),
    "qwen2-biases": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(num_key_value_heads=2)),
}


def save_tiny(case: str, folder: Path) -> torch.nn.Module:
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra)).eval()
    # Random init is tiny; scale it up so that logits differ enough to make the test bite.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(folder, max_shard_size="200KB")  # several shards + an index
    shutil.copy(SHIPPED_MODELS_DIR / "tokenizer.json", folder / "tokenizer.json")
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_checkpoint_matches_transformers(case, tmp_path):
    hf = save_tiny(case, tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    torch.testing.assert_close(next_token_logits(ours.model, ids[0].tolist()), expected, atol=1e-4, rtol=0)

    prompt = ids[0, :8]
    hf.generation_config.eos_token_id = None  # no stopping, and no EOS suppression either
    with torch.no_grad():
        hf_out = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    assert reference_generate(ours.model, prompt.tolist(), 32, greedy) == hf_out


@pytest.mark.parametrize("name", ["demo", "demo-mha", "demo-mqa", "demo-draft"])
def test_shipped_model_gives_the_same_greedy_text_in_transformers(name):
    ours = load_model(name)
    hf = transformers.LlamaForCausalLM.from_pretrained(SHIPPED_MODELS_DIR / name, dtype=torch.float32).eval()
    prompt = ours.tokenizer.encode("ROMEO:\n")
    with torch.no_grad():  # both stop at the end-of-text token the models learned to emit
        hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, eos_token_id=0,
                             pad_token_id=0)[0, len(prompt):].tolist()
    ours_ids = reference_generate(ours.model, prompt, 60, SamplingParams(temperature=0.0), ours.tokenizer.eos_token_ids)
    assert len(ours_ids) > 10
    assert ours.tokenizer.decode(ours_ids) == ours.tokenizer.decode(hf_ids)
