"""Engine behaviour beyond greedy equality: seeded sampling, block invariants under random
workloads, replay of block events, determinism, and refusal of bad requests."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.state import RunState
from kvscope.backend.events.trace import strip_times
from tests.engine_helpers import mixed_workload, outputs, run_engine


def seeded(rid: str) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, top_k=40, seed=int(rid[1:]) + 100)


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_any_batch(tiny):
    work = mixed_workload(tiny, count=10, seed=5)
    together = outputs(run_engine(tiny, EngineConfig(block_size=4, num_blocks=400), work, seeded))
    squeezed = outputs(run_engine(tiny, EngineConfig(block_size=8, num_blocks=400, max_num_seqs=3,
                                                     max_num_batched_tokens=16), work, seeded))
    for rid, _, prompt, max_tokens in work[:4]:
        alone = outputs(run_engine(tiny, EngineConfig(block_size=4, num_blocks=400), [(rid, 0, prompt, max_tokens)],
                                   seeded))
        assert alone[rid] == together[rid] == squeezed[rid]
    assert len({tuple(v) for v in together.values()}) > 1


workloads = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 12)),  # arrival, prompt len, max tokens
    min_size=1, max_size=8,
)


SPECULATIVE = {"off": None, "ngram": {"method": "ngram", "num_tokens": 3},
               "draft": {"method": "draft", "draft_model": "demo-draft", "num_tokens": 2}}
SAMPLING = {"single": SamplingParams(temperature=0.0), "n": SamplingParams(temperature=1.0, seed=4, n=3),
            "beam": SamplingParams(beam_width=2, n=2)}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=workloads, block_size=st.sampled_from([1, 2, 3, 4, 8]), spare=st.integers(0, 12),
       budget=st.sampled_from([4, 9, 64]), prefix=st.booleans(), static=st.booleans(),
       spec=st.sampled_from(list(SPECULATIVE)), kinds=st.lists(st.sampled_from(list(SAMPLING)), min_size=8, max_size=8))
def test_random_workloads_keep_block_invariants_and_replay_exactly(tiny, draft, work, block_size, spare, budget,
                                                                   prefix, static, spec, kinds):
    # Tiny caches: just enough blocks for the longest request alone, plus a few spare. Forks
    # (n > 1, beams), drafts and their rollbacks all draw on the same small pool.
    longest = max(p + m for _, p, m in work)
    num_blocks = math.ceil((longest + 1) / block_size) + spare
    shared = list(range(3, 3 + 12))
    requests = [(f"r{i}", arrival, (shared + list(range(100 + i, 100 + i + p)))[:p], m)
                for i, (arrival, p, m) in enumerate(work)]
    if spec != "off":  # beam search does not sample, so it cannot be speculated
        kinds = [k if k != "beam" else "n" for k in kinds]
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget,
                          prefix_caching=prefix, batching="static" if static else "continuous", max_model_len=256,
                          speculative=SPECULATIVE[spec])
    state = RunState()
    engine = run_engine(tiny, config, requests, lambda rid: SAMPLING[kinds[int(rid[1:])]], replay=state,
                        draft_model=draft)
    assert engine.blocks.num_used_blocks == 0
    assert state.ref_counts == {} and len(state.free_blocks) == num_blocks


def test_same_scenario_and_seed_give_identical_events(tiny):
    work = mixed_workload(tiny, count=8, seed=9)
    runs = []
    for _ in range(2):
        events = []
        run_engine(tiny, EngineConfig(block_size=4, num_blocks=60, max_num_batched_tokens=32), work, seeded,
                   events=events)
        runs.append(strip_times(events))
    assert runs[0] == runs[1]
    assert any(e["type"] == "token" for e in runs[0])


def test_bad_requests_are_refused_with_a_reason_while_others_finish(tiny):
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=12, max_model_len=60))
    engine.add_request("ok", [5, 6, 7], 4, SamplingParams(temperature=0))
    bad = [
        (("long", list(range(1, 70)), 4, None), "prompt", "max_model_len"),
        (("huge", list(range(1, 59)), 1, None), "prompt", "whole cache"),
        (("neg", [1, 2], 4, {"temperature": -1}), "sampling.temperature", "greater than or equal"),
        (("nan", [1, 2], 4, {"top_p": float("nan")}), "sampling.top_p", "finite"),
        (("unknown", [1, 2], 4, {"temprature": 1}), "sampling.temprature", "Extra inputs"),
        (("zero", [1, 2], 0, None), "max_tokens", "at least 1"),
        (("empty", [], 4, None), "prompt", "empty"),
        (("vocab", [99999], 4, None), "prompt", "outside the vocabulary"),
        (("bias", [1, 2], 4, {"logit_bias": {99999: 1.0}}), "sampling.logit_bias", "token id 99999"),
        (("allowed", [1, 2], 4, {"allowed_token_ids": [3, -1]}), "sampling.allowed_token_ids", "token id -1"),
    ]
    for args, field, reason in bad:
        with pytest.raises(RequestError) as err:
            engine.add_request(*args)
        assert err.value.field == field and reason in err.value.reason, str(err.value)
    engine.add_request("ok2", [8, 9], 3, SamplingParams(temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests["ok"].finish_reason in ("length", "eos")
    assert engine.requests["ok2"].finish_reason in ("length", "eos")
    assert set(engine.requests) == {"ok", "ok2"}


def test_a_sequence_that_outgrows_the_whole_cache_is_aborted_and_the_others_go_on(tiny):
    engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=6, max_model_len=200))
    grower = engine.add_request("grower", [1, 2, 3], 40, SamplingParams(temperature=0, ignore_eos=True))
    small = engine.add_request("small", [4, 5], 2, SamplingParams(temperature=0, ignore_eos=True))
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    assert grower.finish_reason == "abort" and "KV blocks" in grower.abort_reason
    assert small.finish_reason == "length"
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("max_tokens,where,length", [(12, 0.5, 2), (90, 0.8, 12), (90, 0.95, 30)])
def test_stop_strings_end_the_request_and_stay_out_of_the_text(tiny, max_tokens, where, length):
    free = Engine(tiny, EngineConfig(block_size=4, num_blocks=64))
    req = free.add_request("free", [10, 11, 12], max_tokens, SamplingParams(temperature=0, ignore_eos=True))
    while free.has_unfinished():
        free.step()
    text = req.output_text
    stop = text[int(len(text) * where):][:length]  # late and long: the check looks at a tail only
    stopped_engine = Engine(tiny, EngineConfig(block_size=4, num_blocks=64))
    stopped = stopped_engine.add_request("s", [10, 11, 12], max_tokens,
                                         SamplingParams(temperature=0, ignore_eos=True, stop=[stop]))
    by_id = stopped_engine.add_request("t", [10, 11, 12], max_tokens, SamplingParams(
        temperature=0, ignore_eos=True, stop_token_ids=[req.seq.output_token_ids[2]]))
    while stopped_engine.has_unfinished():
        stopped_engine.step()
    assert stopped.finish_reason == "stop" and stopped.output_text == text[: text.find(stop)]
    assert by_id.finish_reason == "stop" and by_id.seq.output_token_ids == req.seq.output_token_ids[:3]


def test_token_events_carry_the_distribution_snapshot(tiny):
    events = []
    params = lambda rid: SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1, logprobs=3)  # noqa: E731
    run_engine(tiny, EngineConfig(block_size=4, num_blocks=64, dist_top_n=4), [("a", 0, [5, 6, 7], 3)], params,
               events=events)
    tokens = [e for e in events if e["type"] == "token"]
    assert [e["position"] for e in tokens] == [3, 4, 5]
    for e in tokens:
        ids = [row[0] for row in e["dist"]["top"]]
        assert e["token_id"] in ids and 0 in ids  # the choice and EOS are always shown
        raw = [row[2] for row in e["dist"]["top"][:4]]
        assert raw == sorted(raw, reverse=True)
        assert sum(row[3] > 0 for row in e["dist"]["top"]) <= 5 + 1  # top-k 5, plus protected EOS
        assert e["dist"]["temperature"] == 0.7 and len(e["top_logprobs"]) == 3


def test_logit_bias_and_allowed_token_ids_steer_the_tokens_and_show_in_the_raw_distribution(tiny):
    events = []
    params = lambda rid: SamplingParams(temperature=0, allowed_token_ids=[7, 9], logit_bias={9: 50.0})  # noqa: E731
    engine = run_engine(tiny, EngineConfig(block_size=4, num_blocks=64, dist_top_n=4), [("a", 0, [5, 6, 7], 3)],
                        params, events=events)
    assert engine.requests["a"].seq.output_token_ids == [9, 9, 9]
    for e in (e for e in events if e["type"] == "token"):
        raw = {row[0]: row[2] for row in e["dist"]["top"]}
        assert raw[9] == pytest.approx(1.0) and raw.get(0, 0.0) == 0.0  # EOS is not allowed: raw 0


def test_num_blocks_follows_from_a_memory_budget_and_the_header_reports_it(tiny):
    events = []
    engine = Engine(tiny, EngineConfig(num_blocks=None, kv_cache_memory_mb=1.0, block_size=16))
    engine.bus.subscribe(events.append)
    engine.emit_header()
    per_token = tiny.config.kv_bytes_per_token("float32")  # 2 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes
    assert per_token == 2 * 2 * 2 * 16 * 4
    assert engine.cache.num_blocks == 1024**2 // (per_token * 16)
    cache = events[0]["cache"]
    assert cache["num_blocks"] == engine.cache.num_blocks and cache["bytes_per_block"] == per_token * 16
    assert engine.cache.data.shape == (2, 2, cache["num_blocks"], 16, 2, 16)  # [L, K/V, blocks, slots, heads, dim]
