"""Tensor parallelism on real ranks: the model sharded over gloo processes gives TP=1's tokens.

Each case runs the same workload at TP=1 and at TP=2 (or 4) and compares every request's tokens and
each token's log-probability (within 1e-5: the row-parallel sums add in another order, so equal to
float rounding, not bit for bit). A TP engine spawns its ranks (about a second each to start), so
the cases are few and small; every engine is closed, and the ranks checked gone.
"""

from __future__ import annotations

import pytest
import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.schema import parse_event
from kvscope.backend.model.loader import load_model
from kvscope.backend.model.sharding import check_tensor_parallel, shard_model, shard_plan
from kvscope.backend.errors import KvscopeError
from tests.engine_helpers import GREEDY, mixed_workload, run_engine



SMALL = dict(block_size=4, num_blocks=200, max_num_batched_tokens=24)  # chunked prefill: prompts up to 90 tokens


def run(loaded, config: EngineConfig, workload, sampling=GREEDY, draft=None) -> tuple[Engine, list[dict]]:
    events: list[dict] = []
    engine = run_engine(loaded, config, workload, sampling, events=events, draft_model=draft)
    engine.close()
    ranks = getattr(engine.executor.runner, "ranks", None)
    assert ranks is None or all(p.poll() is not None for p in ranks.processes), "a rank outlived its engine"
    return engine, events


def tokens_and_logprobs(events: list[dict]) -> tuple[dict, dict]:
    tokens: dict[tuple[str, int], list[int]] = {}
    logprobs: dict[tuple[str, int, int], float] = {}
    for e in events:
        if e["type"] == "token":
            tokens.setdefault((e["request_id"], e["seq_id"]), []).append(e["token_id"])
            logprobs[e["request_id"], e["seq_id"], e["position"]] = e["logprob"]
    return tokens, logprobs


def assert_same_run(one: list[dict], many: list[dict], tolerance: float = 1e-5) -> None:
    tokens_1, logprobs_1 = tokens_and_logprobs(one)
    tokens_n, logprobs_n = tokens_and_logprobs(many)
    assert tokens_n == tokens_1
    assert logprobs_n.keys() == logprobs_1.keys()
    worst = max(abs(logprobs_n[k] - logprobs_1[k]) for k in logprobs_1)
    assert worst <= tolerance, f"log-probabilities differ by {worst:.2e}"


@pytest.mark.parametrize("name", ["demo", "demo-mha", "demo-mqa", "demo-mla"])
def test_every_attention_variant_at_tp2_equals_tp1(name):
    loaded = load_model(name)
    work = mixed_workload(loaded, count=6, seed=5)
    _, one = run(loaded, EngineConfig(**SMALL), work)
    engine, two = run(loaded, EngineConfig(**SMALL, tensor_parallel=2), work)
    assert_same_run(one, two)
    header, steps = two[0], [e for e in two if e["type"] == "iteration" and e["batch"]]
    parse_event(header)
    layers = loaded.config.num_hidden_layers
    assert all(s["allreduce"]["count"] == 2 * layers for s in steps), "o_proj and down_proj: one all-reduce each"
    assert all(s["allreduce"]["bytes"] > 0 and s["allreduce"]["ms"] >= 0 for s in steps)


def test_tp4_replicates_kv_heads_when_there_are_fewer_than_ranks(demo):
    work = mixed_workload(demo, count=4, seed=9)
    _, one = run(demo, EngineConfig(**SMALL), work)
    _, four = run(demo, EngineConfig(**SMALL, tensor_parallel=4), work)
    assert_same_run(one, four)
    layout = four[0]["tensor_parallel"]
    assert layout["kv_heads_replicated"] and [r["kv_heads"] for r in layout["ranks"]] == [[0, 1], [0, 1], [1, 2], [1, 2]]
    assert [r["heads"] for r in layout["ranks"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]


MODES = {
    "prefix-caching": (dict(block_size=4, num_blocks=200), GREEDY),
    "preemption": (dict(block_size=4, num_blocks=16, max_num_batched_tokens=64, prefix_caching=False), GREEDY),
    "n-sampled": (dict(block_size=4, num_blocks=400, max_num_seqs=16), SamplingParams(temperature=0.9, seed=3, n=3)),
    "beams": (dict(block_size=4, num_blocks=400, max_num_seqs=16), SamplingParams(beam_width=3)),
    "ngram-speculative": (dict(**SMALL, speculative={"method": "ngram", "num_tokens": 3}), GREEDY),
    "int8-kv": (dict(**SMALL, kv_cache_dtype="int8"), GREEDY),  # a row's scale is per KV head: split with it
}
# int8 KV: a K/V value within float rounding of a code boundary rounds to the next code on one side,
# a step of 1/127 of its row: the tokens stay, log-probabilities move by more than float rounding.
TOLERANCE = {"int8-kv": 1e-3}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_engine_mode_at_tp2_equals_tp1(demo, mode):
    config, sampling = MODES[mode]
    prefix = demo.tokenizer.encode("KING RICHARD III:\nNow is the winter of our discontent\nMade glorious summer")
    work = [(f"p{i}", i * 2, prefix + demo.tokenizer.encode(tail), 10)
            for i, tail in enumerate([" by this sun", " of York;", " and all the clouds", " that lour'd"])]
    _, one = run(demo, EngineConfig(**config), work, sampling)
    engine, two = run(demo, EngineConfig(**config, tensor_parallel=2), work, sampling)
    assert_same_run(one, two, TOLERANCE.get(mode, 1e-5))
    if mode == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the mode must really preempt"
    if mode == "prefix-caching":
        assert engine.requests["p3"].seq.num_cached_prompt_tokens > 0


def test_speculative_with_the_draft_model_on_rank_0(demo, draft):
    """The draft model runs whole on rank 0 (it is small); only the target is sharded."""
    work = mixed_workload(demo, count=4, seed=2)
    config = dict(**SMALL, speculative={"method": "draft", "draft_model": "demo-draft", "num_tokens": 3})
    _, one = run(demo, EngineConfig(**config), work, draft=draft)
    engine, two = run(demo, EngineConfig(**config, tensor_parallel=2), work, draft=draft)
    assert_same_run(one, two)
    assert engine.spec_stats.num_verifies > 0


@pytest.mark.parametrize("weights", [pytest.param("float32", marks=pytest.mark.slow), "native"])  # the same shards
def test_smollm2_at_tp3_equals_tp1(weights):
    """SmolLM2 has 9 heads and 3 KV heads: 2 ranks cannot share them, 3 can (one KV head each).

    float32: tokens and log-probabilities as above. The GGUF file as stored (int4 groups, bfloat16
    kernels): the same tokens; its log-probabilities carry bfloat16's rounding of each partial sum."""
    loaded = load_model("smollm2", weights=weights)
    with pytest.raises(KvscopeError, match="does not divide the model's 9 attention heads"):
        check_tensor_parallel(loaded.config, 2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    work = [(f"r{i}", 0, loaded.tokenizer.encode(p), 12) for i, p in enumerate(prompts)]
    _, one = run(loaded, EngineConfig(block_size=16, num_blocks=32), work)
    _, three = run(loaded, EngineConfig(block_size=16, num_blocks=32, tensor_parallel=3), work)
    if weights == "float32":
        assert_same_run(one, three)
    else:
        assert tokens_and_logprobs(three)[0] == tokens_and_logprobs(one)[0]


def test_a_shard_holds_its_share_and_the_header_says_so(demo):
    """Each rank reads 1/TP of the layers' weights and holds 1/TP of the KV heads."""
    halves = [shard_model(demo.model, shard_plan(demo.config, r, 2)) for r in range(2)]
    embedding = demo.model.model.embed_tokens.weight.numel()
    whole = sum(p.numel() for p in demo.model.parameters()) - embedding
    for half in halves:
        layers = sum(p.numel() for p in half.parameters()) - embedding
        norms = sum(p.numel() for n, p in half.named_parameters() if "norm" in n)
        assert layers - norms == (whole - norms) // 2
    _, events = run(demo, EngineConfig(num_blocks=64, tensor_parallel=2), [("a", 0, demo.tokenizer.encode("Hi"), 2)])
    header = events[0]
    assert header["cache"]["bytes_per_block"] * 2 == demo.config.kv_bytes_per_token("float32") * 16
    assert [r["kv_bytes"] for r in header["tensor_parallel"]["ranks"]] == [header["cache"]["bytes_per_block"] * 64] * 2


@pytest.mark.parametrize("tp, says", [(3, "does not divide the model's 8 attention heads"),
                                      (16, "does not divide the model's 8 attention heads")])
def test_a_degree_the_model_cannot_take_is_refused_naming_the_constraint(demo, tp, says):
    with pytest.raises(RequestError, match=says) as refused:
        Engine(demo, EngineConfig(tensor_parallel=tp))
    assert refused.value.field == "engine.tensor_parallel"


def test_quantized_layers_shard_to_the_same_output():
    """int8 and int4 layers slice their codes, scales and zeros: a shard computes its part of the same product."""
    from kvscope.backend.model.quant import QuantLinear
    from kvscope.backend.model.sharding import _columns, _rows

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    x = torch.randn(3, 128)
    for mode, group in (("int8", 128), ("int8", 0), ("int4", 32)):
        q = QuantLinear.from_linear(linear, mode, group)
        rows = torch.arange(16, 48)
        torch.testing.assert_close(_columns({}, q, rows)(x), q(x)[:, 16:48], rtol=0, atol=0)
        halves = [_rows({}, q, (0, 64)), _rows({}, q, (64, 128))]
        for h in halves:
            h.all_reduce = lambda y: y
        summed = halves[0](x[:, :64]) + halves[1](x[:, 64:])
        torch.testing.assert_close(summed, q(x), rtol=2**-7, atol=2**-7 * q(x).abs().max().item())
