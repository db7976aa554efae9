"""The dashboard's pure parts: sampler stages, the feed, the history, and what the views send."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.sampler import final_distribution
from backend.engine.sampling_params import SamplingParams
from backend.events.bus import EventBus
from backend.run import ScenarioRun
from backend.scenario import validate
from frontend.client import RunFeed
from frontend.new_run import overrides_of
from frontend.sampling_math import Knobs, compute_stages
from frontend.views.base import Js, js
from frontend.views.batch import MERGED, column_segments
from frontend.views.kv_calc import bytes_per_token, inputs_from_header
from frontend.views.timeline import merge_runs
from tests.conftest import make_tiny_model

EOS = 0
PROBS = [0.02, 0.40, 0.30, 0.15, 0.08, 0.05]  # token 0 is EOS
TOP = [[i, f"t{i}", p, 0.0] for i, p in enumerate(PROBS)]


def engine_final(**kw) -> list[float]:
    logits = torch.tensor(PROBS).log()[None]
    return final_distribution(logits, [SamplingParams(**kw)], [EOS])[0].tolist()


def ours(**kw) -> list[float]:
    """Our final stage, back in token-id order."""
    stages = compute_stages(TOP, Knobs(**kw), {EOS}, vocab_size=len(PROBS))
    by_id = dict(zip(stages.token_ids, stages.probs["min_p"]))
    return [by_id[i] for i in range(len(PROBS))]


@pytest.mark.parametrize("kw", [
    {}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 2}, {"top_p": 0.7}, {"top_p": 0.71},
    {"min_p": 0.3}, {"top_k": 2, "truncate_eos": True}, {"temperature": 0.7, "top_k": 3, "top_p": 0.8, "min_p": 0.1},
    {"temperature": 0.0},
])  # fmt: skip
def test_stages_match_the_engine_sampler_when_the_whole_vocabulary_is_shown(kw):
    assert ours(**kw) == pytest.approx(engine_final(**kw), abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=12), t=st.floats(0.1, 3.0),
       k=st.integers(0, 12), p=st.floats(0.05, 1.0), m=st.floats(0.0, 1.0))
def test_stages_match_the_sampler_for_any_distribution(weights, t, k, p, m):
    total = sum(weights)
    probs = [w / total for w in weights]
    top = [[i, "", q, 0.0] for i, q in enumerate(probs)]
    stages = compute_stages(top, Knobs(t, k, p, m), {0}, vocab_size=len(probs))
    by_id = dict(zip(stages.token_ids, stages.probs["min_p"]))
    mine = [by_id[i] for i in range(len(probs))]
    logits = torch.tensor(probs, dtype=torch.float64).log()[None]
    theirs = final_distribution(logits, [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)], [0])[0]
    assert mine == pytest.approx(theirs.tolist(), abs=1e-5)


def test_the_tail_stands_for_the_tokens_not_shown():
    top = [[1, "a", 0.5, 0.6], [2, "b", 0.2, 0.4]]  # 0.3 of the mass is elsewhere in a 1000-token vocab
    stages = compute_stages(top, Knobs(temperature=1.0, top_k=2), {0}, vocab_size=1000)
    assert stages.tail["raw"] == pytest.approx(0.3)
    assert stages.tail_count == 2  # at most 0.2 each
    assert stages.tail["top_k"] == 0.0 and sum(stages.probs["top_k"]) == pytest.approx(1.0)
    assert sum(stages.probs["temperature"]) + stages.tail["temperature"] == pytest.approx(1.0)


# ---- the feed -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    """Every event of a small scenario on the tiny model, prefix caching and a preemption included."""
    scenario = validate({
        "name": "recorded", "model": "unused", "seed": 0,
        "engine": {"block_size": 4, "num_blocks": 12, "max_num_seqs": 4, "max_num_batched_tokens": 16},
        "generate": {"count": 5, "arrival": {"process": "burst"}, "prompt_tokens": {"min": 6, "max": 10},
                     "max_tokens": {"min": 6, "max": 12}, "shared_prefix": {"tokens": 8, "fraction": 1.0},
                     "sampling": {"temperature": 0.8, "seed": 3}},
    }, "test")  # fmt: skip
    bus = EventBus()
    events: list[dict] = []
    bus.subscribe(events.append)
    ScenarioRun(scenario, bus, loaded=make_tiny_model()).run()
    return events


def snapshot_of(events: list[dict]) -> dict:
    from backend.events.state import RunState

    state = RunState()
    for e in events:
        state.apply(e)
    return json.loads(json.dumps({**state.snapshot(), "type": "snapshot", "kind": "scenario"}))


def test_feed_applies_events_after_a_snapshot_and_keeps_a_log(recorded):
    feed = RunFeed(None, "r")
    feed.handle(snapshot_of(recorded[:1]), recv_ms=1.0)
    assert feed.epoch == 1 and feed.state.num_blocks == 12
    for i, e in enumerate(recorded[1:]):
        feed.handle(e, recv_ms=2.0 + i)
    assert feed.state.finished and feed.state.free_blocks
    assert feed.since(feed.version) == []
    tail = feed.since(feed.version - 3)
    assert [entry.event for entry in tail] == recorded[-3:]
    assert tail[0].recv_ms == 2.0 + len(recorded) - 4


def test_a_view_too_far_behind_the_log_must_redraw(recorded):
    feed = RunFeed(None, "r", log_size=10)
    feed.handle(snapshot_of(recorded[:1]))
    for e in recorded[1:]:
        feed.handle(e)
    assert feed.since(feed.version - 10) is not None
    assert feed.since(feed.version - 11) is None


def test_a_resync_snapshot_is_the_same_state_as_the_events(recorded):
    live = RunFeed(None, "r")
    live.handle(snapshot_of(recorded[:1]))
    for e in recorded[1:40]:
        live.handle(e)
    resynced = RunFeed(None, "r")
    resynced.handle(snapshot_of(recorded[:40]))
    assert resynced.state.snapshot() == live.state.snapshot()
    assert resynced.epoch == 1 and live.epoch == 1


def test_history_records_waiting_preempted_and_masks(recorded):
    feed = RunFeed(None, "r")
    feed.handle(snapshot_of(recorded[:1]))
    for e in recorded[1:]:
        feed.handle(e)
    history = feed.history
    kinds = {c.kind for col in history.columns for c in col.cells}
    assert {"prefill", "decode", "waiting"} <= kinds  # 5 requests, 4 slots: someone waits
    if feed.state.num_preemptions:
        assert "preempted" in kinds
    assert list(history.rows) == [f"g{i}" for i in range(5)]
    rid = next(iter(history.tokens))
    steps = history.mask_steps(rid)
    assert steps and all(any(m["request_id"] == rid for m in history.masks[s]) for s in steps)
    assert len(history.metrics) == len(history.columns)
    assert {f.request_id for f in history.finishes} == set(feed.state.requests)


# ---- what the views send ------------------------------------------------------------------------------


def test_js_leaves_functions_unquoted():
    assert js({"renderItem": Js("kvscope.timelineCell"), "data": [[1, "a"]]}) == \
        '{"renderItem":kvscope.timelineCell,"data":[[1,"a"]]}'


def test_timeline_merges_runs_of_one_phase():
    # [x0, x1, row, kind, tokens, step, request_id]
    cells = [[s - 0.5, s + 0.5, 0, 2, 1, s, "a"] for s in range(4)] + [[3.5, 4.5, 0, 1, 8, 4, "a"]] + \
        [[s - 0.5, s + 0.5, 1, 0, 0, s, "b"] for s in (0, 1, 3)]
    merged = merge_runs(cells)
    assert [(m[2], m[3], m[0], m[1], m[4], m[5], m[7]) for m in merged] == [
        (0, 2, -0.5, 3.5, 4, 0, 3), (0, 1, 3.5, 4.5, 8, 4, 4), (1, 0, -0.5, 1.5, 0, 0, 1), (1, 0, 2.5, 3.5, 0, 3, 3)]


def test_batch_segments_stack_and_many_decodes_share_one():
    from frontend.history import Cell, Column, RunHistory

    history = RunHistory(rows={"a": 0, "b": 1})
    col = Column(7, 1.0, 0.1, [Cell("a", "prefill", 16), Cell("b", "decode", 1), Cell("c", "waiting")], 17, 64, 4)
    # top-down: [step, y0, y1, colour, phase, request, tokens]
    assert column_segments(col, history) == [[7, 16, 17, 1, 0, "b", 1], [7, 0, 16, 0, 1, "a", 16]]
    many = Column(8, 1.0, 0.1, [Cell(f"r{i}", "decode", 1) for i in range(20)] + [Cell("a", "prefill", 8)], 28, 64, 32)
    assert column_segments(many, history) == [[8, 20, 28, 0, 1, "a", 8], [8, 0, 20, MERGED, 0, "20 requests", 20]]


def test_overrides_are_only_what_differs_from_the_scenario():
    base = {"model": "demo", "block_size": 16, "batching": "continuous", "prefix_caching": True}
    form = {**base, "block_size": 8.0, "prefix_caching": False, "num_blocks": None}
    assert overrides_of(form, base) == {"engine.block_size": 8, "engine.prefix_caching": False}


@pytest.mark.parametrize("variant", [{"n_kv_heads": 2}, {"n_kv_heads": 1}, {"n_kv_heads": 4}, {"mla": True}])
def test_calculator_agrees_with_the_engine_header(variant):
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    Engine(make_tiny_model(**variant), EngineConfig(num_blocks=8, block_size=4), bus).emit_header()
    header = events[0]
    inputs = inputs_from_header(header["model"], header["cache"])
    assert inputs.variant == header["model"]["attention"]
    assert bytes_per_token(inputs) == header["model"]["kv_bytes_per_token"]


def test_batch_merges_equal_consecutive_columns():
    from frontend.views.batch import merge_columns

    items = [[s, 0, 1, 3, 0, "a", 1] for s in (4, 5, 6, 8)] + [[5, 1, 9, 2, 1, "b", 8]]
    assert merge_columns(items) == [[4, 6, 0, 1, 3, 0, "a", 1], [5, 5, 1, 9, 2, 1, "b", 8], [8, 8, 0, 1, 3, 0, "a", 1]]


def test_chunks_keep_a_small_live_series_and_seal_the_rest():
    from frontend.views.chunks import Chunks

    chunks = Chunks("x-", size=4, era=8)
    for step in range(10):
        chunks.add(step, step)
    assert chunks.take_dirty() == [("x-e0", [0, 1, 2, 3, 4, 5, 6, 7]), ("x-live", [8, 9])]
    chunks.add(10, 10)
    assert chunks.take_dirty() == [("x-live", [8, 9, 10])]
    chunks.add(12, 12)  # a new chunk: 8..11 seal into the second era
    assert chunks.take_dirty() == [("x-e1", [8, 9, 10]), ("x-live", [12])]
    assert chunks.all() == [("x-e0", [0, 1, 2, 3, 4, 5, 6, 7]), ("x-e1", [8, 9, 10]), ("x-live", [12])]
