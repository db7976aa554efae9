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
    ttft, tpot = rows["mean TTFT (measured on this CPU)"], rows["mean TPOT (measured on this CPU)"]
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
    assert all(t is not None and t > 0 for t in figures["tokens/s (measured on this CPU)"])


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


def test_colocated_against_disaggregated_is_an_axis_named_in_words():
    from kvscope.frontend.compare import AXES, override_of
    from kvscope.frontend.side_by_side import value_name

    axis = AXES["disaggregation"]
    split = {"prefill_instances": 1, "decode_instances": 1}
    assert [override_of(axis, v) for v in (axis.a, axis.b)] == [{"engine.disaggregation": None},
                                                                 {"engine.disaggregation": split}]
    assert [value_name(axis.path, v) for v in (None, split)] == ["colocated", "disaggregated (1 + 1)"]


def test_a_run_that_has_not_started_compares_as_empty():
    empty = RunRecord()
    rows = rows_of(empty, empty)
    assert rows["iterations"] == (0, 0) and rows["prefill tokens computed"] == (0, 0)
    assert rows["mean TTFT (measured on this CPU)"] == (None, None)




def test_the_row_of_differences_bolds_what_differs_and_both_columns_share_the_longer_x_range(caching):
    on, off, on_events, _ = caching
    table = differences_html(compare_rows(on, off), side_titles(on, off))
    assert '<th class="kv-side-run">prefix caching: off</th>' in table
    off_tokens = rows_of(on, off)["prefill tokens computed"][1]
    assert f'<td class="kv-differs">{off_tokens:,}</td>' in table  # the lesson's figure, in bold
    assert "finished requests 10" in table.split("the same in both:")[1]  # one line, not a column per figure
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
    measured = rows["tokens/s (measured on this CPU)"]
    assert measured == tuple(round(t / (0.01 * n), 1) for t, n in zip(tokens, iterations))
    assert measured[1] > measured[0]


def _cases(tiny_dir: str, batching: str) -> tuple[dict, ...]:
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    ScenarioRun(load_scenario("continuous-batching", [f"engine.batching={batching}", "generate.count=6",
                                                        f"model={tiny_dir}"]),
                bus=bus).run()
    return tuple(events)


def modelled_on_h100(record: RunRecord):
    from kvscope.backend.perf.hardware import get_hardware
    from kvscope.backend.perf.model_run import run_deployment
    from kvscope.frontend.hardware import ModelledRun, run_header

    dep, shaped = run_deployment(run_header(record.state), get_hardware("h100"))
    run = ModelledRun(dep, shaped.source)
    run.extend(record.history.columns)
    return run


def test_the_row_of_differences_leads_with_the_modelled_gpu_and_ends_with_the_cpu_it_measured(tiny_dir):
    """static 169 tok/s against continuous 150 (#38): the headline was this shared CPU's wall clock. The
    row leads with both runs priced on the columns' hardware, continuous ahead, and the measured times
    come last, saying where they were measured."""
    from kvscope.frontend.side_by_side import modelled_rows, significant

    static, continuous = (RunRecord.from_events(_cases(tiny_dir, b)) for b in ("static", "continuous"))
    runs = [modelled_on_h100(r) for r in (static, continuous)]
    rows = modelled_rows((static, continuous), runs, ("H100", "H100")) + compare_rows(static, continuous)
    labels = [r.label for r in rows]
    assert labels[:4] == ["tokens/s (modelled, H100)", "mean TTFT (modelled, H100)", "mean TPOT (modelled, H100)",
                          "time for the run (modelled, H100)"]
    assert labels[-4:] == [f"{name} (measured on this CPU)" for name in
                           ("tokens/s", "mean TTFT", "mean TPOT", "median decode step")]
    figures = {r.label: (r.a, r.b) for r in rows}
    tokens_per_s, modelled_run = figures["tokens/s (modelled, H100)"], figures["time for the run (modelled, H100)"]
    assert 0 < tokens_per_s[0] < tokens_per_s[1] and modelled_run[0] > modelled_run[1] > 0  # continuous ahead
    assert modelled_run == tuple(significant(r.total_s * 1e3) for r in runs)
    table = differences_html(rows, side_titles(static, continuous))
    columns, same = table.split("the same in both:")
    assert columns.index("tokens/s (modelled, H100)") < columns.index("iterations") < columns.index("measured on this CPU")
    assert "weights 1.2 MiB" in same  # equal in both: one line under the table, not a column
    assert f'<td class="kv-differs">{tokens_per_s[1]:,.0f}</td>' in table  # the headline figure, in bold
    other = modelled_rows((static, continuous), [runs[0], None], ("H100", "A100 80GB"))
    assert other[0].label == "tokens/s (modelled, H100 / A100 80GB)" and other[0].b is None  # not priced yet


def test_block_size_1_against_16_costs_16_times_the_entries_hashes_and_gathers(tiny_dir):
    """Block size 16 vs 1 at the same bytes: one block per token means a table entry, a hash and a gather
    per token where 16-token blocks need one per 16 tokens."""
    from kvscope.backend.events.compare import block_costs
    from kvscope.frontend.views.block_cost import block_sizes_differ

    big, small = (RunRecord.from_events(_trace(tiny_dir, f"engine.block_size={size}", f"engine.num_blocks={n}"))
                  for size, n in ((16, 256), (1, 4096)))
    costs = [block_costs(r) for r in (big, small)]
    for record, cost, size in zip((big, small), costs, (16, 1)):
        cells = [c for col in record.history.columns for c in col.scheduled]
        longest: dict[str, int] = {}
        for c in cells:
            longest[c.request_id] = max(longest.get(c.request_id, 0), c.context_len)
        decodes = [c.context_len for c in cells if c.kind == "decode"]
        assert cost.gathers == sum(-(-n // size) for n in decodes) and cost.decode_rows == len(decodes) > 0
        assert cost.hashed_blocks == sum(n // size for n in longest.values())
        assert cost.table_entries == max(sum(-(-c.context_len // size) for c in col.scheduled)
                                         for col in record.history.columns)
    assert costs[1].gathers > 10 * costs[0].gathers and costs[1].hashed_blocks > 14 * costs[0].hashed_blocks
    assert costs[1].table_entries > 10 * costs[0].table_entries
    assert block_sizes_differ(big, small) and not block_sizes_differ(big, big)
    off = RunRecord.from_events(_trace(tiny_dir, "engine.prefix_caching=false"))
    assert block_costs(off).hashed_blocks is None  # nothing is hashed with prefix caching off
