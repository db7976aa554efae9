"""Weight-only quantization (backend/model/quant.py) and the int8 KV cache, from the quantizer's
arithmetic up to the engine's header, the Triton path and the benchmark."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest
import torch
import torch.nn as nn

from kvscope.backend.config import EngineConfig, ModelConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.kv_cache import KVCache, quantize_rows_int8
from kvscope.backend.engine.request import RequestError
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.attention import DenseCausalBackend
from kvscope.backend.model import quant
from kvscope.backend.model.quant import (QuantError, QuantLinear, dequantize_weight, pack_int4, quantize_model,
                                 quantize_weight, unpack_int4, weight_bytes)
from kvscope.backend.model.transformer import CausalLM
from tests.conftest import make_tiny_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}


# ---- the quantizer ----------------------------------------------------------------------------------


def test_int4_packing_round_trips_every_code_exactly_two_per_byte():
    codes = torch.randint(-8, 8, (6, 40), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    codes[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every representable value, at both nibbles
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 20)
    assert torch.equal(unpack_int4(packed), codes)
    assert packed[0, 0].item() == (-8 + 8) | ((-7 + 8) << 4)  # column 0 low nibble, column 1 high


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [0, 32, 64])
def test_dequantized_weights_are_within_half_a_step_of_the_originals(mode, group_size):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    codes, scales = quantize_weight(w, mode, group_size)
    qmax = 127 if mode == "int8" else 7
    assert codes.abs().max().item() == qmax  # each group's absmax lands on the top code
    assert scales.shape == ((48, 128 // group_size) if group_size else (1, 1))
    step = scales.expand(48, -1).repeat_interleave(group_size or 128 * 48, dim=1)[:, :128]  # [48, 128] per weight
    err = (dequantize_weight(codes, scales, group_size) - w).abs()
    assert (err <= step / 2 * (1 + 1e-5)).all()
    assert err.max() > step.max() / 10, "a bound this loose would be no test"


def test_groups_confine_outlier_columns_that_ruin_one_scale_per_tensor():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    w[:, [5, 77]] *= 60  # outlier input channels, as real LLM activations/weights have
    errors = {}
    for g in (0, 32):
        codes, scales = quantize_weight(w, "int4", g)
        errors[g] = (dequantize_weight(codes, scales, g) - w).pow(2).mean().item()
    assert errors[32] < errors[0] / 5
    # Per tensor, the ordinary weights all round to zero: the outliers took the whole grid.
    codes, _ = quantize_weight(w, "int4", 0)
    ordinary = torch.ones(256, dtype=torch.bool)
    ordinary[[5, 77]] = False
    assert (codes[:, ordinary] == 0).float().mean() > 0.9


def test_quant_linear_stores_packed_bytes_and_computes_with_the_dequantized_weight():
    torch.manual_seed(3)
    linear = nn.Linear(128, 32, bias=True)
    q = QuantLinear.from_linear(linear, "int4", 32)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (32, 64)
    # codes, scales with their zeros [4 groups, 32, 2] bf16 (torch's int4 kernel reads them interleaved), bias
    assert q.kernel == "int4pack" and weight_bytes(q) == 32 * 64 + 4 * 32 * 2 * 2 + 32 * 4
    x = torch.randn(5, 128)
    want = nn.functional.linear(x, q.weight, linear.bias)
    assert (q(x) - want).abs().max() <= KERNEL_TOLERANCE * want.abs().max()
    assert (q(x) - linear(x)).abs().max() < 0.1 * linear(x).abs().max()


# The kernels compute in bfloat16 (quant.py): its rounding of each input and output, measured at
# 0.23-0.35% of the largest output over KERNEL_CASES; a wrong code or scale is off by a whole step.
KERNEL_TOLERANCE = 2**-7

KERNEL_CASES = [  # (mode, group_size, in_features, out_features): every setting the torch kernels take
    ("int8", 0, 128, 32), ("int8", 256, 256, 48), ("int8", 0, 576, 1536),
    ("int4", 32, 128, 32), ("int4", 64, 256, 48), ("int4", 128, 384, 16), ("int4", 256, 512, 64),
    ("int4", 64, 576, 1536),
]


@pytest.mark.parametrize("mode, group_size, k, n", KERNEL_CASES)
def test_torch_kernels_compute_what_the_dequantized_weight_computes(mode, group_size, k, n):
    torch.manual_seed(k + n)
    linear = nn.Linear(k, n, bias=True)
    q = QuantLinear.from_linear(linear, mode, group_size)
    codes, scales = quantize_weight(linear.weight.detach(), mode, group_size, torch.bfloat16)  # a kernel's scales
    assert q.kernel == f"{mode}pack" and torch.equal(q.codes(), codes)  # torch's packing loses nothing
    for shape in ((1, k), (3, 7, k)):  # a decode row; a batch of prefill rows (21: int8 multiplies tiles)
        x = torch.randn(shape)
        want = nn.functional.linear(x, dequantize_weight(codes, scales, group_size), linear.bias)
        assert (q(x) - want).abs().max() <= KERNEL_TOLERANCE * want.abs().max()


def test_int8_layers_switch_to_bfloat16_tiles_at_gemm_rows_and_every_tile_counts(monkeypatch):
    torch.manual_seed(2)
    linear = nn.Linear(96, 37, bias=False)  # 37 rows of codes: tiles of 5 leave a last one of 2
    q = QuantLinear.from_linear(linear, "int8", 0)
    weight = dequantize_weight(*quantize_weight(linear.weight.detach(), "int8", 0, torch.bfloat16), 0)
    tiled, real = [], quant.int8_tiles_matmul
    monkeypatch.setattr(quant, "int8_tiles_matmul", lambda *a: tiled.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(quant, "TILE_BYTES", 2 * 96 * 5)  # five rows of bfloat16 codes a tile
    for m in (quant.GEMM_ROWS - 1, quant.GEMM_ROWS, 3 * quant.GEMM_ROWS):
        x = torch.randn(m, 96)
        want = nn.functional.linear(x, weight)
        assert (q(x) - want).abs().max() <= KERNEL_TOLERANCE * want.abs().max()
    assert tiled == [quant.GEMM_ROWS, 3 * quant.GEMM_ROWS]  # torch's kernel below GEMM_ROWS rows, tiles from there


def test_a_compiled_int8_layer_keeps_one_graph_on_both_sides_of_gemm_rows():
    from torch._dynamo.testing import CompileCounter

    q = QuantLinear.from_linear(nn.Linear(64, 32, bias=False), "int8", 0)
    counter = CompileCounter()  # counts the graphs dynamo hands its backend, and runs them as traced
    compiled = torch.compile(q, backend=counter, dynamic=True)
    for m in (2, quant.GEMM_ROWS + 4, 3):  # a branch on the symbolic batch would compile the second apart
        x = torch.randn(m, 64)
        kernel = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q.qweight, q.row_scales())
        assert torch.equal(compiled(x), kernel.float())
    assert counter.frame_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("mode, group_size, k, n", [("int8", 32, 128, 32), ("int4", 0, 128, 32),
                                                    ("int4", 16, 128, 32), ("int4", 32, 128, 24)])
def test_settings_the_kernels_cannot_express_keep_dequantizing(mode, group_size, k, n):
    torch.manual_seed(1)
    linear = nn.Linear(k, n)
    q = QuantLinear.from_linear(linear, mode, group_size)
    x = torch.randn(2, k)
    assert q.kernel is None and torch.equal(q(x), nn.functional.linear(x, q.weight, linear.bias))


@pytest.mark.parametrize("mode, group_size", [("int8", 0), ("int4", 32)])
def test_a_kernel_layer_holds_no_float_weight_and_never_builds_one(mode, group_size, monkeypatch):
    q = QuantLinear.from_linear(nn.Linear(128, 64, bias=False), mode, group_size)
    floats = [t for t in q.state_dict().values() if t.is_floating_point()]
    assert sum(t.numel() for t in floats) <= 128 * 64 // 16  # scales (and zeros) only: no [64, 128] float
    def no_dequantize(*args):
        raise AssertionError("forward dequantized the weight")
    monkeypatch.setattr(quant, "dequantize_weight", no_dequantize)
    assert q(torch.randn(4, 128)).shape == (4, 64)


def test_quantize_model_builds_a_smaller_copy_and_leaves_the_original_untouched():
    torch.manual_seed(6)
    original = CausalLM(tiny_config(tie_word_embeddings=True, vocab_size=64)).eval()
    assert weight_bytes(original) == sum(p.nbytes for p in original.parameters())  # the tied matrix counted once
    before = {k: v.clone() for k, v in original.state_dict().items()}
    sizes = {}
    for mode in ("int8", "int4"):
        q = quantize_model(original, mode, 32)
        sizes[mode] = weight_bytes(q)
        linears = [m for m in q.modules() if isinstance(m, (nn.Linear, QuantLinear))]
        assert linears and all(isinstance(m, QuantLinear) for m in linears)  # lm_head included
        assert isinstance(q.model.embed_tokens, nn.Embedding) and q.model.embed_tokens.weight.dtype == torch.float32
        assert q.model.embed_tokens.weight.data_ptr() != original.model.embed_tokens.weight.data_ptr()
    assert all(isinstance(m, nn.Linear) for m in (original.lm_head, original.model.layers[0].mlp.up_proj))
    assert original.lm_head.weight is original.model.embed_tokens.weight  # still tied
    assert all(torch.equal(v, before[k]) for k, v in original.state_dict().items())
    assert sizes["int4"] < sizes["int8"] < weight_bytes(original)
    x = torch.arange(10)
    dense = DenseCausalBackend()
    want, got = original.logits(original(x, x, dense)), q.logits(q(x, x, dense))
    assert not torch.equal(got, want) and (got - want).abs().max() < 0.2 * want.abs().max()


def test_a_group_size_that_does_not_divide_a_layer_is_refused_naming_the_field():
    with pytest.raises(QuantError) as e:
        quantize_model(make_tiny_model().model, "int8", 48)  # hidden 64, intermediate 96
    assert e.value.field == "engine.quant_group_size" and "48" in e.value.reason and "64" in e.value.reason


# ---- the int8 KV cache ------------------------------------------------------------------------------


def tiny_config(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8} | kw)


def test_int8_cache_bytes_include_one_float32_scale_per_token_and_kv_head():
    cfg = tiny_config()
    cache = KVCache(cfg, num_blocks=3, block_size=4, dtype=torch.float32, device=torch.device("cpu"), kv_dtype="int8")
    assert cache.data.dtype == torch.int8 and cache.scales.shape == (2, 2, 3, 4, 2)
    assert cache.bytes_per_token == cfg.kv_bytes_per_token("int8") == 2 * 2 * 2 * (8 + 4)
    assert cache.bytes_per_block == 4 * cache.bytes_per_token
    assert cache.bytes_per_block * 3 == cache.data.nbytes + cache.scales.nbytes  # what the pool really holds


def test_int8_cache_round_trips_rows_within_half_a_step_and_copies_scales_with_blocks():
    torch.manual_seed(4)
    cache = KVCache(tiny_config(), 3, 4, torch.float32, torch.device("cpu"), "int8")
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8) * 100  # very different ranges per row
    cache.write(1, torch.tensor([4, 5, 6, 7]), k, v)  # block 1
    for got, want in ((cache.gather_keys(1, [1])[0], k), (cache.gather_values(1, [1])[0], v)):
        step = want.abs().amax(-1, keepdim=True) / 127
        assert ((got - want).abs() <= step / 2 * (1 + 1e-5)).all()
    cache.copy_blocks([(1, 2)])
    assert torch.equal(cache.gather_keys(1, [2]), cache.gather_keys(1, [1]))
    assert torch.equal(cache.gather_values(1, [2]), cache.gather_values(1, [1]))
    assert not torch.equal(cache.gather_values(1, [0]), cache.gather_values(1, [1]))


def test_reading_an_int8_cache_allocates_floats_for_the_sequences_blocks_only():
    """The torch attention path's read of a 4-block sequence from a 256-block int8 pool, measured by the
    profiler's allocations: int8 rows and scales of those blocks, and their floats, once."""
    from torch.profiler import ProfilerActivity, profile

    cfg = tiny_config(num_key_value_heads=2, head_dim=64)
    cache = KVCache(cfg, num_blocks=256, block_size=16, dtype=torch.float32, device=torch.device("cpu"), kv_dtype="int8")
    blocks = torch.tensor([3, 70, 9, 200])
    cache.write(0, torch.arange(16 * 256)[:64], torch.randn(64, 2, 64), torch.randn(64, 2, 64))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keys = cache.gather_keys(0, blocks)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    values = keys.numel()  # 4 blocks x 16 tokens x 2 heads x 64
    assert keys.dtype == torch.float32 and keys.shape == (4, 16, 2, 64)
    # codes (1 B), their scales (4 B a row of 64) and the floats (4 B): 5.06 B a value. A float32 copy
    # first (the old `.float()`) made it 9; the pool's floats would be 64x these blocks'.
    assert allocated <= values * (1 + 4 / 64 + 4) + 1024
    assert allocated < cache.data[0, 0].numel() * 4 / 32


def test_the_torch_quantizer_matches_the_kernels_reference():
    pytest.importorskip("triton")
    from kvscope.kernels.cache_write import quantize_int8_reference

    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(5))
    x[2, 1] = 0.0
    for got, want in zip(quantize_rows_int8(x), quantize_int8_reference(x)):
        assert torch.equal(got, want)


# ---- the engine ---------------------------------------------------------------------------------------


def generate(loaded, config: EngineConfig, prompts: dict[str, str], max_tokens: int = 12):
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    engine = Engine(loaded, config, bus)
    engine.emit_header()
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, max_tokens, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return engine, events[0], {rid: r.seq.output_token_ids for rid, r in engine.requests.items()}


PROMPTS = {"a": "ROMEO:\nWhat light", "b": "JULIET:\n"}


@pytest.fixture(scope="module")
def demo_runs(demo):
    before = {k: v.clone() for k, v in demo.model.state_dict().items()}
    runs = {}
    for wq, kv in (("none", "auto"), ("int8", "auto"), ("int4", "auto"), ("none", "int8")):
        config = EngineConfig(weight_quant=wq, quant_group_size=64, kv_cache_dtype=kv, attention_backend="torch",
                              device="cpu", num_blocks=32)
        runs[(wq, kv)] = generate(demo, config, PROMPTS)
    assert all(torch.equal(v, before[k]) for k, v in demo.model.state_dict().items()), "the shared model changed"
    assert all(isinstance(m, nn.Linear) for m in (demo.model.lm_head, demo.model.model.layers[0].self_attn.q_proj))
    return runs


def test_engine_runs_quantized_weights_and_the_header_reports_their_bytes(demo_runs):
    _, base_header, base_out = demo_runs[("none", "auto")]
    assert base_header["weights"] == {"quant": "none", "group_size": None, "bytes": base_header["weights"]["bytes"],
                                      "bytes_unquantized": base_header["weights"]["bytes"], "layers": {"float32": 43}}
    sizes = {}
    for mode in ("int8", "int4"):
        engine, header, out = demo_runs[(mode, "auto")]
        w = header["weights"]
        assert w["quant"] == mode and w["group_size"] == 64 and w["layers"] == {f"{mode} g64": 43}
        assert w["bytes_unquantized"] == base_header["weights"]["bytes"]
        sizes[mode] = w["bytes"]
        assert isinstance(engine.executor.runner.model.lm_head, QuantLinear)
        assert all(len(t) == 12 for t in out.values())
    assert sizes["int4"] < sizes["int8"] < base_header["weights"]["bytes"] / 2
    assert demo_runs[("int8", "auto")][2] == base_out  # int8 keeps greedy decoding on the demo model


def test_engine_int8_kv_cache_holds_int8_and_reports_honest_bytes(demo_runs, demo):
    engine, header, out = demo_runs[("none", "int8")]
    c = demo.config
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.head_dim + 4)  # int8 values + fp32 scale per row
    assert header["cache"]["dtype"] == "int8" and header["model"]["dtype"] == "float32"
    assert header["model"]["kv_bytes_per_token"] == per_token
    assert header["cache"]["bytes_per_block"] == per_token * header["cache"]["block_size"]
    assert header["cache"]["formula"]["scale_bytes_per_token"] == c.num_hidden_layers * 2 * c.num_key_value_heads * 4
    assert engine.cache.data.dtype == torch.int8 and engine.cache.scales.abs().sum() > 0
    assert out == demo_runs[("none", "auto")][2]  # greedy tokens survive int8 K/V on the demo model


def test_int8_kv_on_the_triton_kernels_gives_the_torch_backends_tokens():
    pytest.importorskip("triton")
    loaded = make_tiny_model()
    prompts = {"short": "ROMEO:\n", "long": "JULIET:\nO Romeo, Romeo, wherefore art thou", "again": "ROMEO:\n"}
    base = dict(kv_cache_dtype="int8", block_size=4, num_blocks=64, max_num_batched_tokens=8, device="cpu")
    torch_engine, _, want = generate(loaded, EngineConfig(attention_backend="torch", **base), prompts, 5)
    triton_engine, header, got = generate(loaded, EngineConfig(attention_backend="triton", **base), prompts, 5)
    assert header["attention_backend"] == "triton" and header["cache"]["dtype"] == "int8"
    assert got == want
    assert torch.allclose(triton_engine.cache.scales, torch_engine.cache.scales, rtol=1e-5, atol=1e-7)
    assert (triton_engine.cache.data.int() - torch_engine.cache.data.int()).abs().max() <= 1


def test_mla_with_int8_kv_on_triton_is_refused_naming_the_field(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RequestError) as e:
        Engine(make_tiny_model(mla=True), EngineConfig(kv_cache_dtype="int8", attention_backend="triton", device="cpu"))
    assert e.value.field == "engine.kv_cache_dtype" and "torch" in e.value.reason


def test_mla_with_int8_kv_runs_on_the_torch_backend():
    loaded = make_tiny_model(mla=True)
    engine, header, out = generate(loaded, EngineConfig(kv_cache_dtype="int8", attention_backend="torch",
                                                        device="cpu", weight_quant="int4", quant_group_size=16),
                                   {"a": "ROMEO:\n"}, 4)
    assert header["model"]["kv_bytes_per_token"] == 2 * (16 + 8 + 4)  # L x (latent + rope + one scale)
    assert len(out["a"]) == 4


def test_engine_refuses_a_group_size_that_does_not_fit(demo):
    with pytest.raises(RequestError) as e:
        Engine(demo, EngineConfig(weight_quant="int4", quant_group_size=48, device="cpu"))
    assert e.value.field == "engine.quant_group_size"
    assert "48" in e.value.reason and "256" in e.value.reason


# ---- the benchmark --------------------------------------------------------------------------------------


def test_bench_quant_smoke(tmp_path, capsys):
    from bench.quant import SETTINGS, main

    out = tmp_path / "quant.json"
    assert main(["--windows", "1", "--chunk", "128", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == [s.name for s in SETTINGS if s.weights != "native"] and result["meta"]["tokens"] == 256
    assert rows["engine-float-kv"]["kl"] < 1e-6  # the engine path itself adds nothing ...
    assert rows["kv-int8"]["kl"] > 1e-7  # ... so this is the int8 cache's own error
    assert 0 < rows["kv-float16"]["kl"] < rows["kv-int8"]["kl"]  # float16's rounding: smaller, not nothing
    assert rows["kv-float16"]["kv_bytes_per_token"] * 2 == rows["none"]["kv_bytes_per_token"]
    assert rows["kv-int8"]["kv_bytes_per_token"] < rows["none"]["kv_bytes_per_token"] / 3
    assert rows["int4-g64"]["weight_bytes"] < rows["int8-g64"]["weight_bytes"] < rows["none"]["weight_bytes"]
    assert len(result["targets"]) == 4
    printed = capsys.readouterr().out
    assert "| setting |" in printed and printed.count("PASS") + printed.count("FAIL") == 4


def test_bench_quant_scores_only_the_settings_named_beside_the_reference(tmp_path):
    from bench.quant import main

    out = tmp_path / "only.json"
    assert main(["--windows", "1", "--chunk", "128", "--only", "int8-g64", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == ["none", "int8-g64"] and result["targets"] == []


@pytest.mark.parametrize("mode, group_size", [("int8", 0), ("int4", 64)])
def test_the_kernel_path_gives_the_dequantizing_paths_greedy_tokens(demo, mode, group_size, monkeypatch):
    config = EngineConfig(weight_quant=mode, quant_group_size=group_size, attention_backend="torch", device="cpu",
                          num_blocks=32)
    engine, _, kernel_out = generate(demo, config, PROMPTS)
    assert isinstance(engine.executor.runner.model.lm_head, QuantLinear) and engine.executor.runner.model.lm_head.kernel
    monkeypatch.setattr(quant, "kernel_for", lambda *args: None)  # the engine quantizes its own copy each time
    engine, _, dequantized_out = generate(demo, config, PROMPTS)
    assert engine.executor.runner.model.lm_head.kernel is None
    assert kernel_out == dequantized_out


def test_bench_quant_speed_row_smoke(capsys):
    from bench.quant_speed import one_row, report

    row = one_row("demo", "int4", 64, "kernel", steps=1)
    assert row["ms"] > 0 and row["bytes"] == 4948992 and len(row["logits"]) == 2048
    rows = [{"name": "int4 g64", "path": path} | row for path in ("kernel", "dequantize")]
    report(rows, argparse.Namespace(model="demo", steps=1, json=None))
    assert "| int4 g64 | kernel |" in capsys.readouterr().out
