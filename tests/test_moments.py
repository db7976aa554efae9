"""The key-moment detector on real traces: engine runs of the shipped scenarios with a tiny model.

Lesson mode pauses where these moments are found, so they must come from the events alone and hold
for any model: here a random tiny model stands in for the demo one.
"""

from __future__ import annotations

from functools import cache

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.moments import MomentFinder, find_moments
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import load_scenario


@cache
def _trace(name: str, model: str, overrides: tuple[str, ...] = ()) -> list[dict]:
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(load_scenario(name, [*overrides, f"model={model}"]), bus=bus).run()
    return events


@pytest.fixture
def trace(tiny_dir: str):
    return lambda name, *overrides: _trace(name, tiny_dir, overrides)


def by_kind(events: list[dict]) -> dict:
    return {m.kind: m for m in find_moments(events)}


def test_first_preemption_names_the_victim_and_the_blocks_it_gave_back(trace):
    events = trace("memory-pressure")
    moment = by_kind(events)["preempt"]
    first = next(e for e in events if e["type"] == "preempt")
    assert (moment.step, moment.request_ids) == (first["step"], (first["request_id"],))
    freed = [e["block_id"] for e in events if e["type"] == "block_free" and e["step"] == first["step"]
             and e["seq_id"] == first["seq_id"]]
    assert moment.blocks == tuple(freed) and len(freed) == first["num_blocks_freed"]
    # complete at the step's metrics event: the state shown then includes the whole step
    closing = next(e for e in events if e["seq"] == moment.seq)
    assert (closing["type"], closing["step"]) == ("metrics", first["step"])
    assert "cache_full" in by_kind(events)


def test_recompute_is_the_first_victim_prefilling_again(trace):
    events = trace("memory-pressure")
    moments = by_kind(events)
    victim = moments["preempt"].request_ids[0]
    recompute = moments["recompute"]
    assert recompute.request_ids == (victim,) and recompute.step > moments["preempt"].step
    it = next(e for e in events if e["type"] == "iteration" and e["step"] == recompute.step)
    assert any(b["request_id"] == victim and b["phase"] == "prefill" for b in it["batch"])
    assert recompute.blocks and all(
        any(e["type"] == "block_alloc" and e["block_id"] == b and e["step"] == recompute.step for e in events)
        for b in recompute.blocks)


def test_without_pressure_there_is_no_preemption_moment(trace):
    assert not {"preempt", "recompute", "cache_full"} & set(by_kind(trace("memory-pressure", "engine.num_blocks=256")))


def test_prefix_hit_gathers_every_block_shared_in_its_step(trace):
    events = trace("shared-prefix")
    moment = by_kind(events)["prefix_hit"]
    shares = [e for e in events if e["type"] == "block_share" and e["step"] == moment.step]
    assert moment.blocks == tuple(e["block_id"] for e in shares) and len(moment.blocks) == 128 // 16
    assert "prefix_hit" not in by_kind(trace("shared-prefix", "engine.prefix_caching=false"))


def test_fork_copy_on_write_and_prune_of_beam_search(trace):
    moments = by_kind(trace("beam-search"))
    assert {"fork", "share", "copy_on_write", "prune"} <= set(moments)
    assert moments["fork"].request_ids == ("beams",) and moments["fork"].blocks
    assert len(moments["copy_on_write"].blocks) >= 2  # source and copy
    assert moments["fork"].step <= moments["prune"].step


def test_each_kind_is_reported_once_and_finished_last(trace):
    moments = find_moments(trace("parallel-sampling"))
    kinds = [m.kind for m in moments]
    assert len(kinds) == len(set(kinds)) and kinds[-1] == "finished"
    assert [m.seq for m in moments] == sorted(m.seq for m in moments)


def test_feeding_one_event_at_a_time_finds_what_the_whole_trace_finds(trace):
    events = trace("parallel-sampling")
    finder = MomentFinder()
    live = [(i, m) for i, e in enumerate(events) for m in finder.feed(e)]
    assert [m for _, m in live] == find_moments(events)
    assert all(events[i]["seq"] == m.seq for i, m in live)  # reported at the event that completes it
