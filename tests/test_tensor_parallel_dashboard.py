"""What the dashboard makes of a tensor-parallel run's events: the reducer's ranks, the history's all-reduces,
the compare rows, the timeline's band, the block pool's strip titles and the calculator's words.

The `tensor-parallel` scenario runs once at two ranks (two processes) and once in one process; everything
below is read from those events, as the page reads them.
"""

from __future__ import annotations

import json

import pytest

from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.compare import compare_rows
from kvscope.backend.events.record import RunRecord
from kvscope.backend.events.state import RunState
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import load_scenario
from kvscope.frontend.column import engine_summary
from kvscope.frontend.side_by_side import side_titles


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
    assert "tensor parallel over 2 ranks" in engine_summary(two.state.config, two.state.cache)
