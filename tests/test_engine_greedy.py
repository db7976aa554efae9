"""Correctness first: in every mode the engine's greedy output equals the plain reference model's.

16 requests of different prompt lengths, output lengths and arrival steps run through the engine;
each must produce exactly the tokens of reference_generate (full recompute, no cache) on its own.
"""

import pytest

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.reference import reference_generate
from kvscope.backend.engine.runner import ModelRunner
from tests.conftest import make_tiny_model
from tests.engine_helpers import GREEDY, mixed_workload, outputs, run_engine

MODES = {
    "continuous": dict(),
    "static": dict(batching="static"),
    "contiguous": dict(kv_layout="contiguous", max_model_len=128, num_blocks=256),
    "no-kv-cache": dict(kv_cache=False, max_num_batched_tokens=512),
    "no-prefix-caching": dict(prefix_caching=False),
    "chunked-budget-7": dict(max_num_batched_tokens=7),
    "chunked-budget-32-static": dict(max_num_batched_tokens=32, batching="static"),
    "no-chunking": dict(chunked_prefill=False, max_num_batched_tokens=128),
    "forced-preemption": dict(block_size=4, num_blocks=30, max_num_batched_tokens=64),
    "block-size-1": dict(block_size=1, num_blocks=2048),
    "block-size-3": dict(block_size=3, num_blocks=700),
    "block-size-16": dict(block_size=16, num_blocks=64),
    # decode-only steps through torch.compile's graph (runner.py), the others eager, in one run
    "compiled-decode": dict(compile_decode=True),
    "compiled-decode-preemption": dict(compile_decode=True, block_size=4, num_blocks=30, max_num_batched_tokens=64),
    "batch-invariant": dict(batch_invariant=True, block_size=4, num_blocks=30, max_num_batched_tokens=7),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_greedy_equals_reference(mode, demo, workload, expected, monkeypatch):
    compiled = []
    monkeypatch.setattr(ModelRunner, "forward_compiled", _spy(ModelRunner.forward_compiled, compiled))
    engine = run_engine(demo, EngineConfig(**MODES[mode]), workload)
    assert outputs(engine) == expected
    assert bool(compiled) == MODES[mode].get("compile_decode", False), "compiled decode steps ran, and only there"
    if mode == "forced-preemption":
        assert engine.scheduler.num_preemptions > 0, "the mode must really preempt"
    if mode == "chunked-budget-7":
        assert any(r.seq.num_prompt_tokens > 7 for r in engine.requests.values())


def _spy(method, calls: list):
    def counted(self, *args):
        calls.append(1)
        return method(self, *args)
    return counted


@pytest.mark.parametrize("variant", ["mqa", "mha", "mla", "mla-compiled"])
def test_every_attention_variant_matches_its_reference(variant):
    loaded = make_tiny_model(n_kv_heads={"mqa": 1, "mha": 4}.get(variant, 4), mla=variant.startswith("mla"))
    work = mixed_workload(loaded, count=8, seed=3)
    config = EngineConfig(block_size=4, num_blocks=200, max_num_batched_tokens=24, compile_decode="compiled" in variant)
    engine = run_engine(loaded, config, work)
    for rid, _, prompt, max_tokens in work:
        assert engine.requests[rid].seq.output_token_ids == reference_generate(loaded.model, prompt, max_tokens, GREEDY, [0])


def test_shared_prefix_is_computed_once_and_still_exact(demo):
    prefix = demo.tokenizer.encode("KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer")
    work = [(f"p{i}", i * 3, prefix + demo.tokenizer.encode(tail), 6)
            for i, tail in enumerate([" by this sun", " of York;", " and all the clouds", " that lour'd"])]
    engine = run_engine(demo, EngineConfig(block_size=4, num_blocks=200), work)
    eos = demo.tokenizer.eos_token_ids
    for rid, _, prompt, max_tokens in work:
        assert engine.requests[rid].seq.output_token_ids == reference_generate(demo.model, prompt, max_tokens, GREEDY, eos)
    cached = [engine.requests[f"p{i}"].seq.num_cached_prompt_tokens for i in range(4)]
    assert cached[0] == 0 and all(c >= len(prefix) // 4 * 4 - 4 for c in cached[1:])
