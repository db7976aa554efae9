"""What the dashboard makes of a tensor-parallel run's events: the reducer's ranks, the history's all-reduces,
the compare rows, the timeline's band, the block pool's strip titles and the calculator's words.

The `tensor-parallel` scenario runs once at two ranks (two processes) and once in one process; everything
below is read from those events, as the page reads them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.compare import compare_rows
from kvscope.backend.events.record import RunRecord
from kvscope.backend.events.state import RunState
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import load_scenario
from kvscope.frontend.column import engine_summary
from kvscope.frontend.export.perfetto import perfetto_trace
from kvscope.frontend.export.replayed import replay
from kvscope.frontend.export.timeline import TimelineArtists
from kvscope.frontend.palette import ALLREDUCE_COLOR
from kvscope.frontend.side_by_side import scale_notes, side_titles
from kvscope.frontend.views.block_pool import pool_text, rank_title
from kvscope.frontend.views.kv_calc import current_model_text, memory_text
from kvscope.frontend.views.timeline import allreduce_item, legend_items, recorded_clock


def record(ranks: int) -> list[dict]:
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    run = ScenarioRun(load_scenario("tensor-parallel", [f"engine.tensor_parallel={ranks}"]), bus=bus)
    run.run()
    run.engine.close()  # the other rank's process ends with the run
    return events


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {ranks: record(ranks) for ranks in (1, 2)}


def test_the_reducer_keeps_what_each_rank_holds_and_a_snapshot_carries_it(runs):
    state = RunRecord.from_events(runs[2]).state
    assert [(r["rank"], r["heads"], r["kv_heads"]) for r in state.ranks] == [(0, [0, 4], [0, 1]), (1, [4, 8], [1, 2])]
    again = RunState.from_snapshot(json.loads(json.dumps(state.snapshot())))
    assert again.tensor_parallel == state.tensor_parallel and again.ranks == state.ranks
    one = RunRecord.from_events(runs[1]).state
    assert one.tensor_parallel is None and one.ranks == []


def test_every_step_keeps_its_all_reduces_live_and_from_a_snapshot(runs):
    live = RunRecord.from_events(runs[2])
    iterations = [e for e in runs[2] if e["type"] == "iteration"]
    assert [c.allreduce for c in live.history.columns] == [e["allreduce"] for e in iterations]
    assert {c.allreduce["count"] for c in live.history.columns} == {12}  # 2 per layer, 6 layers
    joined = RunRecord.from_snapshot(live.state.snapshot())  # a page opened after the run
    assert [c.allreduce for c in joined.history.columns] == [c.allreduce for c in live.history.columns]
    assert all(c.allreduce is None for c in RunRecord.from_events(runs[1]).history.columns)


def test_one_rank_against_two_the_row_gives_bytes_per_rank_and_the_all_reduces(runs):
    one, two = RunRecord.from_events(runs[1]), RunRecord.from_events(runs[2])
    rows = {r.label: (r.a, r.b) for r in compare_rows(one, two)}
    assert rows["weights"] == (19.3, 19.3) and rows["weights per rank"] == (19.3, 10.6)
    assert rows["KV bytes per token per rank"] == (3072, 1536)
    assert rows["bytes per block per rank"] == (49152, 24576)
    assert rows["all-reduces per step"] == (0, 12)
    unsharded, sharded = rows["all-reduce per decode step (rank 0)"]
    assert unsharded == 0.0 and sharded > 0
    assert rows["peak KV blocks"][0] == rows["peak KV blocks"][1]  # the same blocks, half the bytes each
    plain = [r.label for r in compare_rows(one, one)]  # two single-process runs: the rows as they always were
    assert "KV bytes per token" in plain and not [label for label in plain if "rank" in label]
    assert side_titles(one, two) == ("tensor-parallel ranks: 1", "tensor-parallel ranks: 2")
    assert scale_notes(one, two)[1].endswith("2 × 1.5 MiB (a pool per rank) here, 3.0 MiB there")


def test_the_band_is_each_steps_share_in_its_all_reduces_on_either_clock(runs):
    two = RunRecord.from_events(runs[2]).history.columns[3]
    step_ms = 1000 * two.duration_s
    x0, x1, row, share, ms, step, count, size, shown_ms = allreduce_item(two, None)
    assert (x0, x1, row, step, count) == (2.5, 3.5, 0, 3, 12)
    assert (ms, size, shown_ms) == (two.allreduce["ms"], two.allreduce["bytes"], round(step_ms, 2))
    assert share == round(min(1.0, ms / step_ms), 4)
    seconds = allreduce_item(two, recorded_clock)
    assert seconds[1] - seconds[0] == pytest.approx(two.duration_s, abs=1e-4) and seconds[1] == round(two.t, 4)
    assert allreduce_item(RunRecord.from_events(runs[1]).history.columns[3], None) is None
    assert (ALLREDUCE_COLOR, "all-reduce: rank 0's share of the step") in legend_items(allreduce=True)
    assert ALLREDUCE_COLOR not in dict(legend_items())


def test_the_exported_timeline_and_perfetto_trace_carry_the_all_reduces(runs):
    """The timeline picture (still and GIF frames) has the page's band, the Perfetto trace each step's figures."""
    iterations = [e for e in runs[2] if e["type"] == "iteration"]
    run, ax = replay(runs[2]), Figure().add_subplot()
    artists = TimelineArtists(ax, run)
    artists.show(3)  # a GIF frame: the band so far
    assert len(artists.band_steps.get_paths()) == len(artists.band_shares.get_paths()) == 4
    artists.show(run.last)
    widths = [np.ptp(path.vertices[:, 0]) for path in artists.band_shares.get_paths()]
    assert widths == pytest.approx([min(1.0, e["allreduce"]["ms"] / (1000 * e["duration_s"])) for e in iterations])
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "all-reduce"
    one_ax = Figure().add_subplot()
    one = TimelineArtists(one_ax, replay(runs[1]))
    one.show(3)
    assert not one.band and not one.band_steps.get_paths() and "all-reduce" not in [t.get_text() for t in one_ax.get_yticklabels()]
    trace = perfetto_trace(run)["traceEvents"]
    steps = [e for e in trace if e["ph"] == "X" and e["tid"] == 0]
    assert [(e["args"]["allreduce_count"], e["args"]["allreduce_ms"]) for e in steps] == \
        [(12, e["allreduce"]["ms"]) for e in iterations]
    assert sum(e["ph"] == "C" and e["name"].startswith("allreduce") for e in trace) == len(iterations)
    assert not any("allreduce" in e["name"] for e in perfetto_trace(replay(runs[1]))["traceEvents"])


def test_a_ranks_strip_says_what_it_holds_and_the_calculator_the_whole_and_a_share(runs):
    state, one = RunRecord.from_events(runs[2]).state, RunRecord.from_events(runs[1]).state
    assert rank_title(state.ranks[1], 16, False) == \
        "rank 1 · query heads 4–7 · KV head 1 · 24.0 KiB per block, 1.5 MiB in all"
    mqa = {"rank": 1, "heads": [4, 8], "kv_heads": [0, 1], "kv_bytes_per_token": 1536, "kv_bytes": 1572864}
    assert rank_title(mqa, 16, True).startswith("rank 1 · query heads 4–7 · KV head 0 (replicated) · ")
    assert (pool_text(state), pool_text(one)) == ("2 × 1.5 MiB (a pool per rank)", "3.0 MiB")

    text = current_model_text(state.model, state.cache, state.ranks)
    assert "= **3,072 B per token** (6 layers × 128 values × 4 B)" in text
    assert "rank 0 caches KV head 0: **1,536 B per token**, a block of 16 tokens = 24.0 KiB" in text
    assert current_model_text(one.model, one.cache) == current_model_text(one.model, one.cache, one.ranks)
    assert "= **3,072 B per token**" in current_model_text(one.model, one.cache)
    memory = memory_text(state)
    assert "split over 2 ranks: 10.6 MiB of weights on each (a share of every layer, the embedding replicated)" \
        in memory and "1,536 B per token on each rank" in memory
    assert "rank" not in memory_text(one)
    assert engine_summary(state.config, state.cache).endswith(" · tensor parallel over 2 ranks")
    assert "tensor parallel" not in engine_summary(one.config, one.cache)
