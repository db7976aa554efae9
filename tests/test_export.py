"""`kvscope export`: timeline, block pool and batch views drawn from a real trace, and the Perfetto JSON."""

from __future__ import annotations

import json
from collections import defaultdict

import matplotlib.image
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from kvscope.cli import main
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.trace import TraceWriter, read_trace
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario, load_scenario
from kvscope.frontend.export import SLIDE_SIZE, VIEWS, render
from kvscope.frontend.export.figure import request_colors, slide_style
from kvscope.frontend.export.blocks import draw_blocks, pool_area, pool_layout, used_blocks
from kvscope.frontend.export.replayed import busiest_step, replay, segments
from kvscope.frontend.export.timeline import PRUNED_COLOR, draw_timeline
from kvscope.frontend.palette import BLOCK_COLORS

BURST = {"count": 8, "arrival": {"process": "burst"}, "prompt_tokens": {"min": 16, "max": 40},
         "max_tokens": {"min": 12, "max": 30}, "shared_prefix": {"tokens": 16, "fraction": 0.5},
         "sampling": {"temperature": 0.0, "ignore_eos": True}}


def record(tmp_path, model: str, name: str, engine: dict, generate: dict):
    """Run a scenario headless; the trace path and its events (the bus is subscribed before the header)."""
    scenario = Scenario.model_validate({"name": name, "model": model, "engine": engine, "generate": generate})
    path = tmp_path / f"{name}.jsonl"
    bus = EventBus()
    with TraceWriter(path) as writer:
        bus.subscribe(writer)
        ScenarioRun(scenario, bus=bus).run()
    return path, read_trace(path)


@pytest.fixture(scope="module")
def pressure(tmp_path_factory, tiny_dir):
    """More work than blocks: preemptions, prefix sharing, chunked prefill."""
    engine = {"block_size": 8, "num_blocks": 24, "max_num_seqs": 6, "max_num_batched_tokens": 48}
    return record(tmp_path_factory.mktemp("export"), tiny_dir, "memory-pressure", engine, BURST)


def read_png(path) -> np.ndarray:
    return matplotlib.image.imread(path)[..., :3]  # [height, width, rgb], floats in [0, 1]


def distinct_colors(pixels: np.ndarray) -> int:
    return len(np.unique((pixels * 15).round().reshape(-1, 3), axis=0))


@pytest.mark.parametrize("view", VIEWS)
def test_each_view_is_a_full_hd_slide_with_many_colors(pressure, tmp_path, view):
    _, events = pressure
    pixels = read_png(render(events, view, tmp_path / f"{view}.png", step=20 if view == "blocks" else None))
    height, width, _ = pixels.shape
    assert (width, height) == SLIDE_SIZE == (1920, 1080)
    assert pixels.std() > 0.1 and distinct_colors(pixels) >= 8


@pytest.mark.parametrize("view", VIEWS)
def test_no_text_on_a_slide_is_under_16_px_and_the_title_names_scenario_and_step(pressure, view):
    from matplotlib.text import Text

    from kvscope.frontend.export.draw import DRAW

    run = replay(pressure[1], 20)
    with slide_style():  # as render() draws
        fig = DRAW[view](run)
        fig.canvas.draw()  # ticks and legends exist once drawn
    texts = [t for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
    assert texts and min(t.get_fontsize() * fig.dpi / 72 for t in texts) >= 16
    assert "memory-pressure" in fig.get_suptitle() and f"step 20 of {replay(pressure[1]).last}" in fig.get_suptitle()


@pytest.mark.parametrize("size,expected", [("1280", (1280, 720)), ("3840", (3840, 2160)), ("1000x1000", (1000, 1000))])
def test_a_size_alone_keeps_16_9_and_width_x_height_asks_for_another_shape(pressure, tmp_path, size, expected):
    out = tmp_path / "t.png"
    assert main(["export", str(pressure[0]), "--out", str(out), "--size", size]) == 0
    height, width, _ = read_png(out).shape
    assert (width, height) == expected


@pytest.mark.parametrize("view,title", [("timeline", "Timeline"), ("blocks", "KV block pool"),
                                        ("batch", "Batch composition")])
def test_svg_keeps_the_title_as_text(pressure, tmp_path, view, title):
    _, events = pressure
    svg = render(events, view, tmp_path / f"{view}.svg").read_text()
    assert "<svg" in svg and title in svg and "memory-pressure" in svg


def test_a_preempted_request_is_prefilled_again_after_its_gap(pressure):
    run = replay(pressure[1])
    preempted = [r for r, v in run.state.requests.items() if v.num_preemptions]
    assert preempted, "the scenario is meant to run out of blocks"
    for rid in run.state.requests:
        segs = segments(run, rid)
        kinds = [s.kind for s in segs]
        assert all(a.end <= b.start for a, b in zip(segs, segs[1:])), (rid, segs)  # ordered, no overlap
        assert kinds[-1] == "decode" and "prefill" in kinds
        if rid in preempted:
            after = kinds[kinds.index("preempted"):]
            assert after[:2] == ["preempted", "prefill"], kinds  # recompute: its prefix again
        assert segs[-1].end == run.state.requests[rid].finish_step + 1


def test_seconds_on_the_x_axis(pressure, tmp_path):
    out = tmp_path / "t.png"
    assert main(["export", str(pressure[0]), "--out", str(out), "--x", "seconds"]) == 0
    assert read_png(out).shape[:2] == (1080, 1920)


def test_perfetto_json_has_one_track_per_request(pressure, tmp_path):
    path, events = pressure
    out = tmp_path / "timeline.json"
    assert main(["export", str(path), "--out", str(out)]) == 0
    trace = json.loads(out.read_text())["traceEvents"]
    requests = [e["request_id"] for e in events if e["type"] == "request_arrived"]
    threads = {e["args"]["name"]: e["tid"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(requests) <= set(threads) and len({threads[r] for r in requests}) == len(requests)
    spans = defaultdict(list)
    for e in trace:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            spans[e["tid"]].append(e)
    for rid in requests:
        track = sorted(spans[threads[rid]], key=lambda e: e["ts"])
        assert {"prefill", "decode"} <= {e["name"] for e in track}
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(track, track[1:]))  # nests in the viewer
    instants = [e for e in trace if e["ph"] == "i"]
    assert sum(e["name"] == "first token" for e in instants) == len(requests)
    assert sum(e["name"] == "preempted" for e in instants) == sum(e["type"] == "preempt" for e in events) > 0


@pytest.mark.parametrize("view,suffix", [("timeline", ".svg"), ("blocks", ".png"), ("batch", ".png")])
def test_cli_writes_the_file(pressure, tmp_path, capsys, view, suffix):
    out = tmp_path / f"out{suffix}"
    assert main(["export", str(pressure[0]), "--out", str(out), "--view", view, "--step", "30"]) == 0
    assert out.stat().st_size > 1000 and str(out) in capsys.readouterr().out


def write_bad_traces(tmp_path, pressure) -> dict[str, str]:
    lines = pressure[0].read_text().splitlines()
    bad, quiet = tmp_path / "bad.jsonl", tmp_path / "quiet.jsonl"
    bad.write_text(lines[0] + "\n{not json\n")
    quiet.write_text("\n".join(line for line in lines if '"type":"iteration"' not in line) + "\n")
    return {"TRACE": str(pressure[0]), "BAD": str(bad), "QUIET": str(quiet)}


@pytest.mark.parametrize("args,needle", [
    (["missing.jsonl", "--out", "x.png"], "missing.jsonl: no such trace file"),
    (["BAD", "--out", "x.png"], "bad.jsonl:2: not JSON"),
    (["QUIET", "--out", "x.png"], "quiet.jsonl: no iteration events to draw"),
    (["TRACE", "--out", "x.bmp"], "--out x.bmp: unknown format '.bmp'"),
    (["TRACE", "--out", "x.png", "--view", "flame"], "--view flame: not a view"),
    (["TRACE", "--out", "x.json", "--view", "blocks"], "--view blocks: a .json export is the timeline"),
    (["TRACE", "--out", "x.png", "--step", "9999"], "--step 9999: 9999 is outside the trace's iterations"),
    (["TRACE", "--out", "x.png", "--x", "tokens"], "--x tokens: not an x unit"),
    (["TRACE", "--out", "no/such/dir/x.png"], "does not exist"),
    (["TRACE", "--out", "x.png", "--size", "big"], "--size big: use WIDTHxHEIGHT (1920x1080) or a width alone"),
    (["TRACE", "--out", "x.png", "--size", "99999"], "--size 99999: width 640..7680 px"),
])
def test_bad_input_is_one_line_and_exit_2(pressure, tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    names = write_bad_traces(tmp_path, pressure)
    assert main(["export", *[names.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("kvscope export: ") and len(err.strip().splitlines()) == 1


def test_a_2048_block_pool_is_cropped_to_the_rows_its_blocks_were_used_in(tmp_path, tiny_dir):
    engine = {"block_size": 4, "num_blocks": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 64,
              "batching": "static"}
    _, events = record(tmp_path, tiny_dir, "big-pool", engine, {**BURST, "count": 6})
    assert events[0]["cache"]["num_blocks"] == 2048
    pixels = read_png(render(events, "blocks", tmp_path / "blocks.png", step=3))  # bench/latency.py times it
    render(events, "blocks", tmp_path / "blocks.svg", step=3)
    assert (pixels.shape[1], pixels.shape[0]) == SLIDE_SIZE and distinct_colors(pixels) >= 4
    run = replay(events, 3)
    used = used_blocks(run.events)
    layout = pool_layout(2048, used, pool_area(SLIDE_SIZE))
    used_rows = {b // layout.cols for b in used}
    assert used_rows <= set(layout.rows) <= {r + d for r in used_rows for d in (-1, 0, 1)}  # a row of margin
    cells = draw_blocks(run).axes[0].collections[0]
    assert len(cells.get_paths()) == len(layout.rows) * layout.cols < 2048 / 8  # not a mostly empty grid
    batch = read_png(render(events, "batch", tmp_path / "batch.png"))  # static: idle slots drawn
    assert batch.std() > 0.1


def test_rows_nobody_used_between_used_ones_are_left_out_with_a_line_between():
    area = pool_area(SLIDE_SIZE)
    layout = pool_layout(2048, {0, 1, 2, 3, 700}, area)
    assert layout.cols == 8 and layout.rows == [0, 1, 86, 87, 88]  # 700 = row 87, column 4: 5 rows of large cells
    assert pool_layout(24, set(range(24)), area).rows == [0, 1, 2]  # a full small pool: all of it


def test_the_columns_are_those_that_fill_the_slide_with_the_largest_cells():
    area = pool_area(SLIDE_SIZE)  # about 1382 × 778 px
    assert pool_layout(64, {0, 1, 2, 3, 4}, area).cols == 4  # 3 rows of 4: not a band of 8 across an empty slide
    assert pool_layout(64, {0, 1, 2, 3, 4}, pool_area(SLIDE_SIZE, strips=2)).cols == 8  # half the height: 2 rows of 8
    assert pool_layout(4096, set(range(4096)), area).cols == 64  # every block of a large pool: cells of 18 × 12 px


def of_colors(pixels: np.ndarray, colors: list[str]) -> np.ndarray:
    """[height, width] True where a pixel has one of `colors`."""
    return np.any([np.abs(pixels - np.array(to_rgb(c))).max(axis=-1) < 0.01 for c in colors], axis=0)


def cells_extent(pixels: np.ndarray, colors: list[str]) -> tuple[float, float]:
    """The share of the slide's width and height spanned by the pool's cells: pixels of the cell colours, in
    columns and rows that hold many of them (a legend's swatches hold a few)."""
    cell = of_colors(pixels, colors)
    cols, rows = np.flatnonzero(cell.sum(axis=0) > 60), np.flatnonzero(cell.sum(axis=1) > 60)
    return (cols[-1] - cols[0]) / pixels.shape[1], (rows[-1] - rows[0]) / pixels.shape[0]


def test_the_block_pool_fills_the_slide_and_its_title_names_the_peak_it_defaults_to(pressure, tmp_path):
    _, events = pressure
    peak = busiest_step(events)
    run = replay(events, peak)
    with slide_style():
        title = draw_blocks(run).get_suptitle()
    assert f"step {peak} of {run.trace_last}, the peak" in title
    pixels = read_png(render(events, "blocks", tmp_path / "blocks.png"))
    cell_colors = [BLOCK_COLORS["free"], BLOCK_COLORS["cached"], *request_colors(run).values()]
    width, height = cells_extent(pixels, cell_colors)
    assert width > 0.6 and height > 0.65, (width, height)  # the grid, not its margins, fills the slide
    with slide_style():
        assert ", the peak" not in draw_blocks(replay(events, peak + 1)).get_suptitle()  # a step asked for


@pytest.fixture(scope="module")
def tensor_parallel() -> list[dict]:
    """The tensor-parallel scenario at two ranks (two processes, about 6 s)."""
    events: list[dict] = []
    bus = EventBus()
    bus.subscribe(events.append)
    run = ScenarioRun(load_scenario("tensor-parallel", ["engine.tensor_parallel=2"]), bus=bus)
    run.run()
    run.engine.close()
    return events


def test_a_tensor_parallel_pool_is_a_strip_per_rank_titled_with_what_it_holds(tensor_parallel, tmp_path):
    run = replay(tensor_parallel, busiest_step(tensor_parallel))
    with slide_style():
        fig = draw_blocks(run)
    strips = [ax for ax in fig.axes if ax.collections]
    titles = [ax.get_title(loc="left").splitlines()[-1] for ax in strips]
    assert [t.split(" · ")[0] for t in titles] == ["rank 0", "rank 1"]
    assert "KV head 0" in titles[0] and "KV head 1" in titles[1]
    pixels = read_png(render(tensor_parallel, "blocks", tmp_path / "tp.png"))
    held = of_colors(pixels, list(request_colors(run).values()))
    middle = pixels.shape[0] // 2
    assert held[:middle].sum() > 20_000 and held[middle:].sum() > 20_000  # the same blocks held in both strips


def test_the_beam_timeline_draws_the_beam_tree_forks_linked_and_pruned_beams_crossed(tmp_path, tiny_dir):
    generate = {"count": 1, "arrival": {"process": "burst"}, "prompt_tokens": {"min": 6, "max": 6},
                "max_tokens": {"min": 8, "max": 8}, "sampling": {"temperature": 0.0, "beam_width": 2}}
    engine = {"block_size": 4, "num_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    _, events = record(tmp_path, tiny_dir, "beams", engine, generate)
    forks = [e for e in events if e["type"] == "seq_fork"]
    pruned = [e for e in events if e["type"] == "seq_end" and e["reason"] == "pruned"]
    assert forks and pruned
    ax = draw_timeline(replay(events)).axes[0]
    lanes = next(c for c in ax.collections if type(c).__name__ == "LineCollection")
    sequences = len(forks) + 1  # the first one and every fork
    assert len(lanes.get_segments()) == sequences + len(forks)  # a lane each, and a link from each fork to its parent
    crosses = [c for c in ax.collections if len(c.get_offsets()) and len(c.get_facecolor()) and
               np.allclose(c.get_facecolor()[0][:3], to_rgb(PRUNED_COLOR))]
    assert len(crosses) == 1 and len(crosses[0].get_offsets()) == len(pruned)
    assert "beam pruned" in [t.get_text() for t in ax.get_legend().get_texts()]
    pixels = read_png(render(events, "timeline", tmp_path / "beams.png"))
    assert (np.abs(pixels - np.array(to_rgb(PRUNED_COLOR))).max(axis=-1) < 0.02).sum() > 50


def test_verify_phase_and_forked_sequences_export(tmp_path):
    """Speculative verifies get their own colour; n > 1 sequences share their request's row."""

    from kvscope.frontend.export.perfetto import perfetto_trace
    from kvscope.frontend.palette import PHASE_COLORS
    from tests.test_dashboard_units import spec_story

    events = spec_story()
    run = replay(events)
    assert [(s.kind, s.start, s.end) for s in segments(run, "r0")] == [("prefill", 0, 1), ("verify", 1, 3)]
    assert [s.kind for s in segments(run, "r1")] == ["prefill", "decode"]
    pixels = read_png(render(events, "timeline", tmp_path / "timeline.png"))
    assert (np.abs(pixels - np.array(to_rgb(PHASE_COLORS["verify"]))).max(axis=-1) < 0.02).sum() > 100
    for view in ("blocks", "batch"):
        render(events, view, tmp_path / f"{view}.svg")
    assert "verify" in {e["name"] for e in perfetto_trace(run)["traceEvents"]}
