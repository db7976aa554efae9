"""GGUF files run at their own precision (backend/model/gguf_weights.py): Q4 blocks become torch int4
layers holding the file's own codes, other quantized types int8 rows, and the logits stay within the
stated tolerance of the de-quantized float model (`weights="float32"`, the reference tests/test_gguf.py
holds to transformers). The tiny files are tests/test_gguf.py's; SmolLM2's real file at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn as nn
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.reference import next_token_logits, reference_generate
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model import gguf_loader
from kvscope.backend.model.gguf_weights import int4_groups
from kvscope.backend.model.loader import load_model
from kvscope.backend.model.quant import QuantEmbedding, QuantLinear, quantize_loaded, weight_bytes
from tests.engine_helpers import outputs, run_engine
from tests.test_gguf import HEADS, KV_HEADS, cache_dir, llama_cpp_permute, write_tiny_gguf  # noqa: F401 (a fixture)
from tests.test_smollm2 import CHAT, chat_prompt, needs_smollm2

INT4 = [Q.Q4_0, Q.Q4_1, Q.Q4_K]
INT8_ROWS = [Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
# The native path against the de-quantized float model, both logits at fp32: bfloat16 scales and
# activations (quant.py), and for 5-8 bit types a per-row int8 grid. Measured on these random tiny
# files, two prompts each: max |Δlogit| / max |logit| 0.3-1.5% (Q4_*, Q5_K), 2.4-3.6% (Q8_0, Q5_0,
# Q5_1: re-quantized per row); KL 6e-5-4.5e-4 per token. Not Q6_K: tests/test_gguf.py's random Q6_K
# blocks make weights of std 0.31 (the others' 0.05), a model so hot that any rounding changes its
# output (KL 0.2-1.9 here); its per-row re-quantization error is the others' (0.6-0.7% RMS), which
# the half-step test holds.
LOGIT_TOLERANCE = 0.05  # of the largest logit
KL_TOLERANCE = 1e-3


def linear_tensors(path):
    """(the tensor info, its Hugging Face name) of every matrix in the file."""
    reader = gguf.GGUFReader(path)
    f = gguf_loader.GGUFFile(path, reader)
    return [(t, gguf_loader.hf_tensor_name(f, t.name)) for t in reader.tensors if len(t.shape) == 2]


def module_for(model: nn.Module, name: str) -> nn.Module:
    if name == "model.embed_tokens.weight":
        return model.lm_head  # tied in these files only when asked; untied, token_embd is the embedding
    return model.get_submodule(name.removesuffix(".weight"))


def hf_rows(t, w: torch.Tensor) -> torch.Tensor:
    """Our q/k rows back in the file's (llama.cpp's RoPE) order, so they compare with its blocks."""
    if ".attn_q." in t.name or ".attn_k." in t.name:
        return llama_cpp_permute(w, HEADS if ".attn_q." in t.name else KV_HEADS)
    return w


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_q4_blocks_become_int4_layers_holding_the_files_own_codes(qtype, tmp_path):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    model = load_model(path).model
    for t, name in linear_tensors(path):
        if name == "model.embed_tokens.weight":
            continue
        expected = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))  # gguf's own reading
        codes, scales, zeros = int4_groups(t)
        # the blocks' codes and float16 scales, read by kvscope, give gguf's floats exactly
        mine = (codes.float().view(*codes.shape[:1], -1, 32) * scales[..., None] + zeros[..., None]).view(codes.shape)
        torch.testing.assert_close(mine, expected, atol=1e-6, rtol=1e-6)
        layer = module_for(model, name)
        assert isinstance(layer, QuantLinear) and (layer.mode, layer.group_size, layer.kernel) == ("int4", 32, "int4pack")
        assert torch.equal(hf_rows(t, layer.codes()), codes)  # the file's codes, through torch's packing
        assert torch.equal(hf_rows(t, layer.group_scales()), scales.bfloat16())  # rounded to the kernel's dtype
        assert torch.equal(hf_rows(t, layer.group_zeros()), zeros.bfloat16())


@pytest.mark.parametrize("qtype", INT8_ROWS, ids=lambda q: q.name)
def test_other_quantized_types_become_int8_rows_within_half_a_step(qtype, tmp_path):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    model = load_model(path).model
    for t, name in linear_tensors(path):
        expected = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
        if name == "model.embed_tokens.weight":
            embedding = model.model.embed_tokens
            assert isinstance(embedding, QuantEmbedding) and embedding.codes.dtype == torch.int8
            got, step = embedding.weight, embedding.scales.float()  # [vocab, 1]
        else:
            layer = module_for(model, name)
            assert isinstance(layer, QuantLinear) and (layer.kernel, layer.group_size) == ("int8pack", layer.in_features)
            got, step = hf_rows(t, layer.weight), hf_rows(t, layer.group_scales().float())
        assert ((got - expected).abs() <= step * 0.5 * (1 + 2**-7) + 1e-7).all(), name


def test_float_tensors_load_as_float_layers(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny-F16.gguf", Q.F16)
    native, floats = load_model(path).model, load_model(path, weights="float32").model
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in native.modules())
    assert all(torch.equal(a, b) for a, b in zip(native.state_dict().values(), floats.state_dict().values()))


def test_a_native_model_holds_no_float_copy_of_a_quantized_weight(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    model = load_model(path).model
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 2 * 7 + 1  # every projection and lm_head
    floats = {name: t for name, t in model.state_dict().items() if t.is_floating_point()}
    assert all(t.dim() == 1 or "scales" in name for name, t in floats.items())  # norms, and scales (with zeros)
    assert all(m.scales_and_zeros.numel() == m.in_features * m.out_features // 16 for m in quantized)  # 2 per 32
    assert weight_bytes(model) < weight_bytes(load_model(path, weights="float32").model) / 4


def test_a_tied_embedding_reads_the_output_layers_int8_rows(tmp_path):
    path = write_tiny_gguf(tmp_path / "tied.gguf", Q.Q8_0, tied=True)
    model = load_model(path).model
    embedding, lm_head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, QuantEmbedding) and lm_head.kernel == "int8pack"
    assert embedding.codes.data_ptr() == lm_head.qweight.data_ptr()  # one matrix serves both ends
    ids = torch.tensor([0, 5, 2047])
    assert torch.equal(embedding(ids), lm_head.weight[ids])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_1, Q.Q5_K], ids=lambda q: q.name)
def test_native_logits_are_within_the_stated_tolerance_of_the_dequantized_model(qtype, tmp_path):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    native, floats = load_model(path).model, load_model(path, weights="float32").model
    prompt = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = next_token_logits(native, prompt), next_token_logits(floats, prompt)
    assert not torch.equal(got, want)  # the kernels did run: bfloat16 leaves a trace
    assert (got - want).abs().max() <= LOGIT_TOLERANCE * want.abs().max()
    kl = torch.sum(want.softmax(-1) * (want.log_softmax(-1) - got.log_softmax(-1)))
    assert kl < KL_TOLERANCE


def test_the_engine_on_a_native_model_gives_the_reference_models_greedy_tokens(tmp_path):
    loaded = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1))
    prompts = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 33)]
    config = EngineConfig(num_blocks=64, max_model_len=128, events="off", block_size=8)
    got = outputs(run_engine(loaded, config, [(f"r{i}", 0, p, 24) for i, p in enumerate(prompts)], GREEDY, check=False))
    for i, p in enumerate(prompts):  # batched, chunked and paged against one sequence at a time
        assert got[f"r{i}"] == reference_generate(loaded.model, p, 24, GREEDY)


def test_quantizing_a_native_model_again_is_refused_naming_the_field(tmp_path):
    loaded = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1))
    with pytest.raises(RequestError) as e:
        Engine(loaded, EngineConfig(weight_quant="int8", num_blocks=8))
    assert e.value.field == "engine.weight_quant" and "Q4_1 ×16" in e.value.reason and "float32" in e.value.reason
    engine = Engine(loaded, EngineConfig(num_blocks=8))
    summary = engine.weights
    assert summary["gguf"] == {"F32": 5, "Q4_1": 16} and summary["layers"] == {"int4 g32": 15}
    assert (summary["quant"], summary["group_size"]) == ("int4", 32)
    assert summary["bytes"] == weight_bytes(loaded.model) < summary["bytes_unquantized"] / 4


# ---- SmolLM2's real file ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_native():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def smol_float():
    return load_model("smollm2", weights="float32")


@needs_smollm2
def test_smollm2_runs_its_q4_1_file_at_its_own_size(smol_native):
    _, summary = quantize_loaded(smol_native, "none", 64)
    assert summary["gguf"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert summary["layers"] == {"int4 g32": 210, "int8 per row": 1}  # Q8_0 token_embd: the tied lm_head
    assert 90e6 < summary["bytes"] < 100e6 and summary["bytes_unquantized"] == 538_060_032


@needs_smollm2
def test_smollm2_native_answers_as_the_dequantized_model_does(smol_native, smol_float):
    prompt = chat_prompt(smol_native)
    config = EngineConfig(num_blocks=16, max_model_len=256, events="off")
    params = SamplingParams(temperature=0.0)
    answers = [smol.tokenizer.decode(outputs(run_engine(smol, config, [("r", 0, prompt, 20)], params, check=False))["r"])
               for smol in (smol_native, smol_float)]
    assert answers == ["The capital of France is Paris.<|im_end|>"] * 2
    text = smol_native.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3 + CHAT[0]["content"])
    with torch.inference_mode():  # every position of a text, teacher-forced
        ids, positions = torch.tensor(text), torch.arange(len(text))
        from kvscope.backend.model.attention import DenseCausalBackend
        got, want = (m.model.logits(m.model(ids, positions, DenseCausalBackend())) for m in (smol_native, smol_float))
    kl = torch.sum(want.softmax(-1) * (want.log_softmax(-1) - got.log_softmax(-1)), dim=-1)
    assert kl.mean() < 5e-3 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@needs_smollm2
def test_smollm2_native_holds_no_float_weights_in_memory():
    """RSS after load, in a fresh process: the native model is its ~95 MB of codes, the float one 538 MB."""
    script = ("import ctypes, gc, json, sys, torch, kvscope\n"
              "from kvscope.backend.model.loader import load_model\n"
              "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
              "base = rss()\n"
              "loaded = load_model('smollm2', weights=sys.argv[1])\n"
              "gc.collect(); ctypes.CDLL('libc.so.6').malloc_trim(0)\n"
              "print(json.dumps(rss() - base))\n")
    grew = {w: json.loads(subprocess.run([sys.executable, "-c", script, w], capture_output=True, text=True,
                                         check=True, timeout=300).stdout) for w in ("native", "float32")}
    assert grew["native"] < 200e6 < 538e6 < grew["float32"]  # measured: 143 MB (95 of weights) and 540 MB
