"""`kvscope export`: timeline, block pool and batch views drawn from a real trace, and the Perfetto JSON."""

from __future__ import annotations

import json
from collections import defaultdict

import matplotlib.image
import numpy as np
import pytest

from kvscope.cli import main
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.trace import TraceWriter, read_trace
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario
from kvscope.frontend.export import VIEWS, render
from kvscope.frontend.export.replayed import replay, segments

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
def test_each_view_is_a_large_picture_with_many_colors(pressure, tmp_path, view):
    _, events = pressure
    pixels = read_png(render(events, view, tmp_path / f"{view}.png", step=20 if view == "blocks" else None))
    height, width, _ = pixels.shape
    assert width >= 800 and height >= 400
    assert pixels.std() > 0.1 and distinct_colors(pixels) >= 8


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
    assert read_png(out).shape[1] >= 800


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
])
def test_bad_input_is_one_line_and_exit_2(pressure, tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    names = write_bad_traces(tmp_path, pressure)
    assert main(["export", *[names.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("kvscope export: ") and len(err.strip().splitlines()) == 1


def test_a_2048_block_pool_renders_every_block(tmp_path, tiny_dir):
    engine = {"block_size": 4, "num_blocks": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 64,
              "batching": "static"}
    _, events = record(tmp_path, tiny_dir, "big-pool", engine, {**BURST, "count": 6})
    assert events[0]["cache"]["num_blocks"] == 2048
    pixels = read_png(render(events, "blocks", tmp_path / "blocks.png", step=3))  # bench/latency.py times it
    render(events, "blocks", tmp_path / "blocks.svg", step=3)
    assert pixels.shape[1] >= 800 and distinct_colors(pixels) >= 4
    batch = read_png(render(events, "batch", tmp_path / "batch.png"))  # static: idle slots drawn
    assert batch.std() > 0.1


def test_verify_phase_and_forked_sequences_export(tmp_path):
    """Speculative verifies get their own colour; n > 1 sequences share their request's row."""
    from matplotlib.colors import to_rgb

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
