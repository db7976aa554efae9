"""GGUF files load in kvscope and compute what transformers computes from the same file.

Tiny GGUF files are written here with gguf.GGUFWriter: a 2-layer llama config, random weights, the
demo models' byte-level BPE vocabulary; no download. One file per tensor type: the types gguf can
quantize are quantized from random floats with gguf.quants.quantize; the K-quants (which it can only
de-quantize) are random raw blocks with finite fp16 scales. kvscope's weights must equal
gguf.quants.dequantize of the same bytes, and logits (1e-4, fp32) and 64 greedy tokens must equal
transformers' loading of the same file: these tests load with weights="float32" (de-quantized);
the native path, the files' own blocks through torch's int4/int8 kernels, is tests/test_gguf_native.py.
SmolLM2's real file: tests/test_smollm2.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model import gguf_loader
from kvscope.backend.model.loader import SHIPPED_MODELS_DIR, ModelLoadError, load_model, resolve_model_dir
from kvscope.backend.engine.reference import next_token_logits, reference_generate
from kvscope.backend.model.tokenizer import EOS_TEXT, Tokenizer

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 2048
TEMPLATE = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Byte offsets of a K-quant block's fp16 super-block scale (d) and, for Q4_K/Q5_K, min (dmin), with
# the scale magnitude that keeps weights near std 0.05; every other byte of a block is valid as any value.
K_QUANTS = {Q.Q4_K: ((0, 2), 2e-4), Q.Q5_K: ((0, 2), 1e-4), Q.Q6_K: ((208,), 3e-4)}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Each test converts into its own cache, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kvscope" / "gguf"


def demo_vocab() -> tuple[list[str], list[str]]:
    """The shipped tokenizer's tokens in id order and its merges, as a GGUF stores them."""
    model = json.loads((SHIPPED_MODELS_DIR / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in K-quant block layout, with finite, small fp16 scales in the scale slots."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    offsets, scale = K_QUANTS[qtype]
    for i, offset in enumerate(offsets):  # d, then dmin: a min near the mean keeps weights centred
        value = rng.uniform(0.5, 1.0, blocks.shape[:2]) * scale * (1 if i == 0 else 10)
        blocks[..., offset:offset + 2] = value.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def tensor_shapes(arch: str, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        shapes |= {f"{b}.attn_norm.weight": (HIDDEN,), f"{b}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
                   f"{b}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN), f"{b}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"{b}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM), f"{b}.ffn_norm.weight": (HIDDEN,),
                   f"{b}.ffn_gate.weight": (FFN, HIDDEN), f"{b}.ffn_up.weight": (FFN, HIDDEN),
                   f"{b}.ffn_down.weight": (HIDDEN, FFN)}
        if arch == "qwen2":
            shapes |= {f"{b}.attn_q.bias": (HEADS * HEAD_DIM,), f"{b}.attn_k.bias": (KV_HEADS * HEAD_DIM,),
                       f"{b}.attn_v.bias": (KV_HEADS * HEAD_DIM,)}
    return shapes


def add_tensor(writer: gguf.GGUFWriter, name: str, shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> None:
    if len(shape) == 1:  # norms and biases stay F32, as llama.cpp keeps them
        base = 1.0 if name.endswith("norm.weight") else 0.0
        writer.add_tensor(name, (base + 0.1 * rng.standard_normal(shape)).astype(np.float32))
    elif qtype in K_QUANTS:
        writer.add_tensor(name, random_k_blocks(qtype, *shape, rng), raw_dtype=qtype)
    else:
        data = gguf.quants.quantize((0.05 * rng.standard_normal(shape)).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)


def write_tiny_gguf(path: Path, qtype: Q = Q.F32, arch: str = "llama", name: str = "tiny", tied: bool = False,
                    pre: str = "default", tokenizer_model: str = "gpt2", extra: dict | None = None) -> Path:
    """A tiny random decoder in a GGUF file, as llama.cpp's converter lays one out."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    tokens, merges = demo_vocab()
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == EOS_TEXT else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    for tensor_name, shape in tensor_shapes(arch, tied).items():
        add_tensor(w, tensor_name, shape, qtype, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Hugging Face's q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_undoing_the_rope_permutation_restores_hugging_face_row_order():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)
    assert torch.equal(gguf_loader.unpermute_rope_rows(llama_cpp_permute(w, 2), 2), w)


@pytest.mark.parametrize("qtype", QUANTIZABLE + list(K_QUANTS), ids=lambda q: q.name)
def test_weights_equal_gguf_dequantize_of_the_same_bytes(qtype, tmp_path):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    params = dict(load_model(path, weights="float32").model.named_parameters())
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} == {Q.F32, qtype}
    for t in reader.tensors:
        expected = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
        name = gguf_loader.hf_tensor_name(gguf_loader.GGUFFile(path, reader), t.name)
        ours = params[name].detach()
        if ".attn_q." in t.name or ".attn_k." in t.name:
            ours = llama_cpp_permute(ours, HEADS if ".attn_q." in t.name else KV_HEADS)
        assert torch.equal(ours, expected), t.name
    assert expected.std() > 0.01  # the weights are not degenerate


def test_weights_are_dequantized_to_the_engine_dtype(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q8_0)
    half = load_model(path, dtype=torch.float16, weights="float32").model.model.layers[0].mlp.up_proj.weight
    up = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    expected = dequantize(up.data, up.tensor_type)
    assert half.dtype == torch.float16
    assert torch.equal(half.detach(), torch.from_numpy(np.array(expected)).half())


BRIEF_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# (file options, also compare 64 greedy tokens): logits for every type, greedy runs for a few (each costs seconds).
CASES = {f"llama-{q.name}": (dict(qtype=q), q in (Q.F32, Q.Q4_K)) for q in BRIEF_TYPES} | {
    "qwen2-biases-Q8_0": (dict(qtype=Q.Q8_0, arch="qwen2"), True),
    "mistral-tied-Q6_K": (dict(qtype=Q.Q6_K, name="Mistral-tiny", tied=True), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_gguf_matches_transformers_loading_the_same_file(case, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    options, greedy = CASES[case]
    ours = load_model(write_tiny_gguf(tmp_path / f"{case}.gguf", **options), weights="float32")
    # transformers with gguf 0.19 fails on a file named "mistral" (it looks for a gguf architecture of
    # that name), so it reads a twin named otherwise: Mistral computes as Llama without a sliding window.
    hf_file = write_tiny_gguf(tmp_path / "twin.gguf", **{**options, "name": "tiny"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=str(hf_file), dtype=torch.float32).eval()
    assert ours.config.architecture == ("MistralForCausalLM" if "mistral" in case else type(hf).__name__)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits[0, -1]
    torch.testing.assert_close(next_token_logits(ours.model, ids[0].tolist()), expected, atol=1e-4, rtol=0)
    if greedy:
        prompt = ids[0, :8]
        hf.generation_config.eos_token_id = None  # no stopping, and no EOS suppression either
        with torch.no_grad():
            hf_out = hf.generate(prompt[None], max_new_tokens=64, do_sample=False, pad_token_id=0)[0, 8:].tolist()
        assert reference_generate(ours.model, prompt.tolist(), 64, GREEDY) == hf_out


def test_the_tokenizer_built_from_metadata_encodes_as_the_original(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    tok = load_model(path).tokenizer
    original = Tokenizer.from_file(SHIPPED_MODELS_DIR / "tokenizer.json")
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n<|endoftext|>JULIET:\n  Ay me! 1234 ünïcödé\n"
    assert tok.encode(text) == original.encode(text)
    assert tok.encode(EOS_TEXT) == [0]  # the control token stays whole
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == [0]
    assert tok.chat_template == TEMPLATE


def test_smollm_pre_tokenizer_splits_digits_one_by_one_as_llama_cpp_does(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre="smollm")
    tok = load_model(path).tokenizer
    assert [tok.token_text(i) for i in tok.encode("x 2024")] == ["x", " ", "2", "0", "2", "4"]


def test_the_converted_folder_is_cached_and_reused_until_the_file_changes(tmp_path, cache_dir, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = resolve_model_dir(path)
    assert first.parent == cache_dir and (first / "model.safetensors").is_file()
    assert json.loads((first / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_conversion)
    assert load_model(path, weights="float32").path == first  # the second start reads only the cache
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model_dir(path)
    assert gguf_loader.cache_key(path, torch.float16) != gguf_loader.cache_key(path, torch.float32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="gemma2"), "general.architecture: unsupported 'gemma2'"),
    (dict(tokenizer_model="llama"), "tokenizer.ggml.model: 'llama' is not supported"),
    (dict(extra={"llama.rope.scaling.type": "yarn"}), "llama.rope.scaling.type: 'yarn' is not supported"),
])
def test_an_unsupported_file_is_one_line_naming_the_field(kwargs, message, tmp_path):
    path = write_tiny_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_an_unsupported_tensor_type_names_the_tensor(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_0)
    monkeypatch.setattr(gguf_loader, "SUPPORTED_TYPES", (Q.F32,))
    with pytest.raises(ModelLoadError, match=r"tensor token_embd.weight has type Q4_0 \(supported: F32\)"):
        load_model(path)


def test_a_file_that_is_not_gguf_or_is_missing_is_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(bad)
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(tmp_path / "absent.gguf")


def test_a_model_folder_keeps_its_chat_template_on_the_tokenizer(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(SHIPPED_MODELS_DIR / "demo-draft" / name)
    assert load_model(folder).tokenizer.chat_template is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": "A"}]}))
    assert load_model(folder).tokenizer.chat_template == "A"
    (folder / "chat_template.jinja").write_text("B")
    assert load_model(folder).tokenizer.chat_template == "B"
