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


# -- the moments of the scenarios that teach scheduling (greedy, ignore_eos: the steps are the model's own) --


def test_a_request_queues_when_every_slot_is_busy_and_takes_the_first_slot_freed_beside_the_decodes(trace):
    moments = by_kind(trace("continuous-batching"))
    queued, refilled = moments["queued"], moments["slot_refilled"]
    assert (queued.step, queued.request_ids, queued.blocks) == (7, ("g4",), ())  # g0..g3 hold the 4 slots
    # g3 finished at iteration 17; g4, waiting since 7, prefills at 18 beside three decodes, in one new block
    assert (refilled.step, refilled.request_ids, refilled.blocks) == (18, ("g4",), (13,))


def test_static_batching_never_refills_a_slot_while_others_decode(trace):
    moments = by_kind(trace("continuous-batching", "engine.batching=static"))
    assert "queued" in moments and "slot_refilled" not in moments


def test_poisson_load_queues_then_refills(trace):
    moments = by_kind(trace("poisson-load"))
    assert (moments["queued"].step, moments["queued"].request_ids) == (12, ("g2",))
    assert (moments["slot_refilled"].step, moments["slot_refilled"].request_ids) == (29, ("g4",))


def test_the_first_prefill_chunk_is_what_the_budget_leaves_beside_the_decodes(trace):
    events = trace("chunked-prefill")
    chunk = by_kind(events)["prefill_chunk"]
    assert (chunk.step, chunk.request_ids, chunk.blocks) == (4, ("long",), (3, 4, 5, 6))  # 62 tokens: 4 blocks
    it = next(e for e in events if e["type"] == "iteration" and e["step"] == 4)
    batch = [(b["request_id"], b["num_query_tokens"]) for b in it["batch"]]
    assert batch == [("short-1", 1), ("short-2", 1), ("long", 62)]
    assert "prefill_chunk" not in by_kind(trace("chunked-prefill", "engine.max_num_batched_tokens=512"))


def test_a_long_prompt_is_chunked_then_cached_then_grows_a_block_at_a_time(trace):
    moments = by_kind(trace("long-prompt"))
    assert (moments["prefill_chunk"].step, moments["prefill_chunk"].blocks) == (0, tuple(range(16)))  # 256 tokens
    assert (moments["prompt_cached"].step, moments["prompt_cached"].blocks) == (2, tuple(range(38)))  # 600 tokens
    assert moments["first_decode"].step == 3
    assert (moments["block_added"].step, moments["block_added"].blocks) == (11, (38,))  # token 609: a 39th block
    assert moments["prompt_cached"].request_ids == moments["block_added"].request_ids == ("long",)


def test_the_first_decode_without_a_kv_cache_recomputes_the_whole_context(trace):
    on, off = trace("kv-cache-off"), trace("kv-cache-off", "engine.kv_cache=false")
    for events, tokens in ((on, [1, 1]), (off, [25, 41])):
        moment = by_kind(events)["first_decode"]
        it = next(e for e in events if e["type"] == "iteration" and e["step"] == moment.step)
        assert moment.step == 1 and moment.request_ids == ("a", "b")
        assert [b["num_query_tokens"] for b in it["batch"]] == tokens
    added = by_kind(on)["block_added"]
    assert (added.step, added.blocks, added.request_ids) == (9, (5, 6), ("a", "b"))  # 33rd token of a, 49th of b


def test_paged_adds_blocks_as_tokens_come_and_contiguous_reserves_the_pool_up_front(trace):
    paged = by_kind(trace("paged-vs-contiguous"))
    assert (paged["prompt_cached"].step, paged["prompt_cached"].blocks) == (0, tuple(range(16)))
    added = paged["block_added"]
    assert (added.step, added.blocks, added.request_ids) == (1, (16,), ("g4",))
    assert "queued" not in paged
    contiguous = by_kind(trace("paged-vs-contiguous", "engine.kv_layout=contiguous"))
    assert contiguous["prompt_cached"].blocks == tuple(range(64))  # 4 requests x 256 / 16
    assert (contiguous["queued"].step, contiguous["queued"].request_ids) == (0, ("g4",))
    assert "block_added" not in contiguous


def test_every_lesson_step_waits_for_a_moment_its_scenario_has(trace):
    from kvscope.backend.scenario import load_scenario

    for name in ("continuous-batching", "kv-cache-off", "paged-vs-contiguous", "poisson-load", "chunked-prefill",
                 "attention-variants", "long-prompt"):
        steps = [s.at for s in load_scenario(name).lesson]
        assert steps[0] == "start" and steps[-1] == "finished" and len(steps) >= 3, name
        assert set(steps) - {"start"} <= set(by_kind(trace(name))), name


def test_the_first_sampled_token_and_the_first_finished_request_name_their_requests(trace):
    events = trace("memory-pressure")
    moments = by_kind(events)
    token = next(e for e in events if e["type"] == "token" and "dist" in e)
    assert moments["first_token"].step == token["step"] and token["request_id"] in moments["first_token"].request_ids
    assert moments["first_token"].views == ("sampling",)
    done = next(e for e in events if e["type"] == "request_finished")
    assert (moments["request_finished"].step, moments["request_finished"].request_ids[0]) == \
        (done["step"], done["request_id"])


def test_the_bound_changes_at_the_first_iteration_under_the_other_roof():
    header = {"type": "header", "seq": 0, "cache": {"num_blocks": 8}}
    def iteration(step: int, bound: str | None) -> dict:
        return {"type": "iteration", "seq": step + 1, "step": step, "batch": [], "kv_blocks_used": 0, "bound": bound}
    events = [header, iteration(0, "compute"), iteration(1, "compute"), iteration(2, "memory"), iteration(3, "compute")]
    [moment] = find_moments(events)
    assert (moment.kind, moment.step, moment.views) == ("bound_changed", 2, ("roofline", "batch"))
    assert find_moments([header, iteration(0, None), iteration(1, None)]) == []  # only simulate mode prices a roof
