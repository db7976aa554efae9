"""Comparing two runs on real traces: shared-prefix with prefix caching on and off, a tiny model.

What the side-by-side page shows under its two columns (the titles and the row of differences) is
computed here from the events alone, so it must hold for any recorded pair of runs.
"""

from __future__ import annotations

from functools import cache

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.compare import compare_rows, setting_differences
from kvscope.backend.events.record import RunRecord
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import load_scenario
from kvscope.frontend.side_by_side import differences_html, shared_x, side_titles


@cache
def _trace(model: str, *overrides: str) -> tuple[dict, ...]:
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(load_scenario("shared-prefix", [*overrides, f"model={model}"]), bus=bus).run()
    return tuple(events)


@pytest.fixture
def caching(tiny_dir: str) -> tuple[RunRecord, RunRecord, tuple[dict, ...], tuple[dict, ...]]:
    on = _trace(tiny_dir, "engine.prefix_caching=true")
    off = _trace(tiny_dir, "engine.prefix_caching=false")
    return RunRecord.from_events(on), RunRecord.from_events(off), on, off


def rows_of(a: RunRecord, b: RunRecord) -> dict:
    return {row.label: (row.a, row.b) for row in compare_rows(a, b)}


def test_without_prefix_caching_every_prompt_token_is_computed_and_with_it_the_hits_are_not(caching):
    on, off, on_events, off_events = caching
    rows = rows_of(on, off)
    prompts = sum(len(e["prompt_token_ids"]) for e in off_events if e["type"] == "request_arrived")
    hits = sum(e["num_cached_prompt_tokens"] or 0 for e in on_events if e["type"] == "request_finished")
    on_tokens, off_tokens = rows["prefill tokens computed"]
    assert off_tokens == prompts
    assert hits > 0 and on_tokens == prompts - hits  # the shared prefix was computed once, then found
    peak_on, peak_off = rows["peak KV blocks"]
    assert peak_on < peak_off  # shared prefix blocks are held once
    assert rows["iterations"] == (on.state.step + 1, off.state.step + 1)
    assert rows["finished requests"] == (10, 10) and rows["preemptions"] == (0, 0)
    ttft, tpot = rows["mean TTFT (engine)"], rows["mean TPOT (engine)"]
    assert all(v is not None and v > 0 for v in (*ttft, *tpot))


def test_a_run_without_a_kv_cache_compares_with_no_kv_and_the_bytes_lead(tiny_dir):
    """A cache-off run reported 7 KV blocks and its bytes were only in a caption: the row leads with
    the bytes a setting changes, and no cache holds none."""
    on = RunRecord.from_events(_trace(tiny_dir, "engine.kv_cache=true"))
    off = RunRecord.from_events(_trace(tiny_dir, "engine.kv_cache=false"))
    rows = compare_rows(on, off)
    assert [r.label for r in rows[:5]] == ["weights", "KV bytes per token", "bytes per block", "peak KV blocks", "peak KV"]
    figures = {r.label: (r.a, r.b) for r in rows}
    per_block, block_size = on.state.cache["bytes_per_block"], on.state.cache["block_size"]
    assert figures["KV bytes per token"] == (per_block // block_size, 0)
    assert figures["bytes per block"] == (per_block, 0)
    blocks_on = figures["peak KV blocks"][0]
    assert blocks_on > 0 and figures["peak KV blocks"][1] == 0
    assert figures["peak KV"] == (round(blocks_on * per_block / 2**20, 2), 0)
    assert all(t is not None and t > 0 for t in figures["tokens/s (engine)"])


def test_the_only_setting_that_differs_names_both_titles(caching):
    on, off, *_ = caching
    assert setting_differences(on, off) == [("engine.prefix_caching", True, False)]
    assert side_titles(on, off) == ("prefix caching: on", "prefix caching: off")
    assert side_titles(on, on) == ("same settings", "same settings")


def test_eager_against_compiled_is_an_axis_named_in_words():
    from kvscope.frontend.compare import AXES, override_of
    from kvscope.frontend.side_by_side import value_name

    axis = AXES["compile_decode"]
    assert [override_of(axis, v) for v in (axis.a, axis.b)] == [{"engine.compile_decode": False},
                                                                 {"engine.compile_decode": True}]
    assert [value_name(axis.path, v) for v in (False, True)] == ["eager", "compiled"]
    assert value_name("engine.prefix_caching", False) == "off" and value_name("engine.stop", ["a"]) == "['a']"


def test_a_run_that_has_not_started_compares_as_empty():
    empty = RunRecord()
    rows = rows_of(empty, empty)
    assert rows["iterations"] == (0, 0) and rows["prefill tokens computed"] == (0, 0)
    assert rows["mean TTFT (engine)"] == (None, None)




def test_the_row_of_differences_bolds_what_differs_and_both_columns_share_the_longer_x_range(caching):
    on, off, on_events, _ = caching
    table = differences_html(compare_rows(on, off), side_titles(on, off))
    assert '<th class="kv-side-run">prefix caching: off</th>' in table
    off_tokens = rows_of(on, off)["prefill tokens computed"][1]
    assert f'<td class="kv-differs">{off_tokens:,}</td>' in table  # the lesson's figure, in bold
    assert '<td class="">10</td>' in table  # finished requests: the same in both
    early = RunRecord.from_events(e for e in on_events if e["step"] <= 5)
    assert early.state.step == 5 < off.state.step
    assert shared_x([early, off]) == {"min": -0.5, "max": off.state.step + 0.5}
    assert shared_x([RunRecord(), RunRecord()]) == {"min": -0.5, "max": 0.5}


def test_a_block_size_compares_the_same_memory_unless_the_block_count_is_held():
    """Block size 16 vs 1 held the block count, so size 1 had 16x fewer slots and preempted for that
    reason alone: the count follows the size, and holding it is a choice."""
    from kvscope.frontend.compare import AXES, override_of

    size = AXES["block_size"]
    form = {"block_size": 16, "num_blocks": 64.0}
    assert override_of(size, 1.0, form) == {"engine.block_size": 1, "engine.num_blocks": 1024}
    assert override_of(size, 16, form) == {"engine.block_size": 16, "engine.num_blocks": 64}
    assert override_of(size, 32, form) == {"engine.block_size": 32, "engine.num_blocks": 32}
    assert override_of(size, 1, form, hold_blocks=True) == {"engine.block_size": 1}
    # a pool sized from a memory budget keeps its bytes by itself
    assert override_of(size, 1, {"block_size": 16, "num_blocks": None}) == {"engine.block_size": 1}
    assert override_of(AXES["num_blocks"], 256.0, form) == {"engine.num_blocks": 256}  # other axes: one override


def test_each_pool_caption_names_both_pools_bytes_and_no_cache_has_no_scale(tiny_dir):
    from kvscope.frontend.side_by_side import scale_notes

    on = RunRecord.from_events(_trace(tiny_dir, "engine.kv_cache=true"))
    off = RunRecord.from_events(_trace(tiny_dir, "engine.kv_cache=false"))
    size = on.state.num_blocks * on.state.cache["bytes_per_block"]
    assert size > 0
    here, there = scale_notes(on, on)
    assert here == there and here.startswith("drawn to scale with the other pool (equal area, equal bytes): ")
    assert scale_notes(on, off) == ("", "")


def test_tokens_per_s_is_the_whole_runs_engine_time_so_continuous_batching_reads_higher(tiny_dir):
    """static vs continuous showed tokens/s 26 vs 26 (#22): the columns' headline was the last 16 iterations'
    rate, the same for two full batches. The row is the run's output tokens over its summed iteration
    durations: with each iteration priced alike (batching is nearly free on this model), the run of fewer
    iterations reads higher, in the ratio of the iterations."""
    def priced(events: tuple[dict, ...]) -> RunRecord:
        return RunRecord.from_events({**e, "duration_s": 0.01} if e["type"] == "iteration" else e for e in events)

    cases = [_cases(tiny_dir, batching) for batching in ("static", "continuous")]
    static, continuous = (priced(events) for events in cases)
    rows = rows_of(static, continuous)
    iterations = rows["iterations"]
    assert iterations[0] > iterations[1]
    tokens = [sum(len(e["output_token_ids"]) for e in events if e["type"] == "request_finished") for events in cases]
    assert tokens[0] == tokens[1] > 0  # ignore_eos: the same work
    assert rows["tokens/s (engine)"] == tuple(round(t / (0.01 * n), 1) for t, n in zip(tokens, iterations))
    assert rows["tokens/s (engine)"][1] > rows["tokens/s (engine)"][0]


def _cases(tiny_dir: str, batching: str) -> tuple[dict, ...]:
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(load_scenario("continuous-batching", [f"engine.batching={batching}", "generate.count=6",
                                                        f"model={tiny_dir}"]),
                bus=bus).run()
    return tuple(events)
