"""A float16 / bfloat16 KV cache under a float32 model: half the bytes, the values rounded once as written,
and the same tokens on every attention path (torch, Triton, compiled decode) and in the byte accounting."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: no GPU here

import pytest
import torch

from kvscope.backend.config import EngineConfig, ModelConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.perf.shapes import shape_from_config
from kvscope.backend.perf.whatif import whatif
from kvscope.backend.server.limits import kv_cache_bytes
from tests.conftest import make_tiny_model
from tests.test_quant import PROMPTS, generate

HALF = ("float16", "bfloat16")


def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("kv", HALF)
def test_a_16_bit_cache_stores_half_the_bytes_and_reads_back_the_rounded_values(kv):
    cfg, dtype = tiny_config(), getattr(torch, kv)
    cache = KVCache(cfg, 3, 4, torch.float32, torch.device("cpu"), kv)
    assert cache.data.dtype == dtype and cache.scales is None
    assert cache.bytes_per_token == cfg.kv_bytes_per_token(kv) == cfg.kv_bytes_per_token("float32") // 2
    assert cache.bytes_per_block * 3 == cache.data.nbytes  # what the pool really holds
    k, v = torch.randn(4, 2, 8) * 1e-3, torch.randn(4, 2, 8) * 300
    cache.write(1, torch.tensor([4, 5, 6, 7]), k, v)  # block 1
    for got, want in ((cache.gather_keys(1, [1])[0], k), (cache.gather_values(1, [1])[0], v)):
        assert got.dtype == torch.float32 and torch.equal(got, want.to(dtype).float())
        assert not torch.equal(got, want)  # rounded: the test would see a float32 cache
    cache.copy_blocks([(1, 2)])
    assert torch.equal(cache.gather_values(1, [2]), cache.gather_values(1, [1]))


@pytest.fixture(scope="module")
def demo_runs(demo):
    config = dict(attention_backend="torch", device="cpu", num_blocks=32)
    return {kv: generate(demo, EngineConfig(kv_cache_dtype=kv, **config), PROMPTS) for kv in ("auto", *HALF)}


@pytest.mark.parametrize("kv", HALF)
def test_the_engine_reports_a_16_bit_cache_and_keeps_greedy_tokens(demo_runs, demo, kv):
    engine, header, out = demo_runs[kv]
    c = demo.config
    assert header["cache"]["dtype"] == kv and header["model"]["dtype"] == "float32"
    assert header["model"]["kv_bytes_per_token"] == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    formula = header["cache"]["formula"]
    assert formula["bytes_per_value"] == 2 and formula["scale_bytes_per_token"] == 0
    assert engine.cache.data.dtype == getattr(torch, kv) and engine.cache.data.any()
    assert out == demo_runs["auto"][2]  # greedy tokens survive 16-bit K/V on the demo model


@pytest.mark.parametrize("kv", HALF)
def test_16_bit_kv_on_the_triton_kernels_gives_the_torch_backends_tokens(kv):
    pytest.importorskip("triton")
    loaded = make_tiny_model()
    prompts = {"short": "ROMEO:\n", "long": "JULIET:\nO Romeo, Romeo, wherefore art thou", "again": "ROMEO:\n"}
    base = dict(kv_cache_dtype=kv, block_size=4, num_blocks=64, max_num_batched_tokens=8, device="cpu")
    torch_engine, _, want = generate(loaded, EngineConfig(attention_backend="torch", **base), prompts, 5)
    triton_engine, header, got = generate(loaded, EngineConfig(attention_backend="triton", **base), prompts, 5)
    assert header["cache"]["dtype"] == kv and got == want
    # layer 0's K/V are the same floats rounded once: equal in float16; in bfloat16 at most a step apart, since
    # TRITON_INTERPRET converts to bfloat16 by truncation (torch, and triton on a GPU, round to nearest)
    got_0, want_0 = (e.cache.data[0].float() for e in (triton_engine, torch_engine))
    assert torch.equal(got_0, want_0) if kv == "float16" else ((got_0 - want_0).abs() <= want_0.abs() * 2**-7).all()


def test_compiled_decode_over_a_float16_cache_gives_the_eager_tokens():
    loaded = make_tiny_model(n_kv_heads=2)
    prompts = {"a": "ROMEO:\n", "b": "JULIET:\nO Romeo"}
    base = dict(kv_cache_dtype="float16", num_blocks=32, device="cpu")
    _, _, want = generate(loaded, EngineConfig(**base), prompts, 8)
    engine, _, got = generate(loaded, EngineConfig(compile_decode=True, **base), prompts, 8)
    assert engine.runtime.compile_s > 0 and got == want


def test_mla_with_a_bfloat16_cache_runs_and_counts_its_latent_in_two_bytes():
    engine, header, out = generate(make_tiny_model(mla=True), EngineConfig(kv_cache_dtype="bfloat16", device="cpu"),
                                   {"a": "ROMEO:\n"}, 4)
    assert header["model"]["kv_bytes_per_token"] == 2 * (16 + 8) * 2  # L x (latent + rope) x 2 bytes
    assert len(out["a"]) == 4


def test_the_byte_accounting_and_the_what_if_price_a_16_bit_cache(demo):
    full, half = (kv_cache_bytes(EngineConfig(num_blocks=64, kv_cache_dtype=kv), demo.config)
                  for kv in ("auto", "float16"))
    assert half * 2 == full

    def kv_bytes(shape, kv: str) -> float:
        return whatif(shape, "h100", batch=32, context=4096, kv_cache_dtype=kv)["memory"]["kv_bytes"]

    assert kv_bytes("llama-3-8b", "float16") == kv_bytes("llama-3-8b", "auto")  # a bfloat16 model's cache is 16-bit
    demo_shape = shape_from_config(demo.config.model_copy(update={"torch_dtype": "float32"}), "demo")  # as it runs here
    assert kv_bytes(demo_shape, "bfloat16") * 2 == kv_bytes(demo_shape, "auto") == 2 * kv_bytes(demo_shape, "float16")


def test_serve_keeps_the_api_runs_kv_in_float16_through_the_openai_client(tmp_path):
    """`kvscope serve --kv-cache-dtype float16`, as a user runs it: the flag reaches every API run's engine, a chat
    through the official client is answered, and the run's header says what the cache stores."""
    import json

    import openai

    from kvscope.backend.server.api_run import ApiEngineFlags, api_engine
    from kvscope.backend.server.manager import RunManager
    from kvscope.cli import build_parser, check_api_engine
    from tests.server_helpers import live_server

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"])
    flags = ApiEngineFlags(kv_cache_dtype=args.kv_cache_dtype)
    check_api_engine("demo", flags)
    assert api_engine("smollm2", flags=flags).kv_cache_dtype == "float16"
    manager = RunManager(default_model="demo", library=None, api_flags=flags)
    with live_server(manager) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "ROMEO:"}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].message.content
        header = json.loads(manager.api_run("demo").trace_jsonl().splitlines()[0])
    assert header["cache"]["dtype"] == "float16" and header["config"]["kv_cache_dtype"] == "float16"


def test_a_bfloat16_cache_moves_between_disaggregated_instances_as_it_is_stored(demo):
    """The KV link sends the pool's own bytes: a 16-bit cache arrives as written, and the split engine gives the
    colocated one's tokens over it."""
    from kvscope.backend.config import DisaggregationConfig
    from kvscope.backend.engine.sampling_params import SamplingParams
    from tests.engine_helpers import mixed_workload
    from tests.test_disaggregation import BASE, results, serve

    work, greedy = mixed_workload(demo, count=6, seed=4), SamplingParams(temperature=0.0)
    colocated = results(serve(demo, EngineConfig(**BASE, kv_cache_dtype="bfloat16"), work, greedy))
    events: list[dict] = []
    split = serve(demo, EngineConfig(**BASE, kv_cache_dtype="bfloat16", disaggregation=DisaggregationConfig()),
                  work, greedy, events)
    assert results(split) == colocated
    moves = [e for e in events if e["type"] == "kv_transfer"]
    per_block = demo.config.kv_bytes_per_token("bfloat16") * BASE["block_size"]  # two bytes a value
    assert moves and all(e["bytes"] == len(e["src_blocks"]) * (per_block + 16) for e in moves)  # + the int64 table
