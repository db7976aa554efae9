"""The animated GIF for slides, and the block pool still at the busiest iteration, named as the peak."""

from __future__ import annotations

import numpy as np
from matplotlib.colors import to_rgb
from PIL import Image

from kvscope.backend.events.state import RunState
from kvscope.cli import main
from kvscope.frontend.export import SLIDE_SIZE, render
from kvscope.frontend.export.blocks import pool_cells
from kvscope.frontend.export.figure import request_colors
from kvscope.frontend.export.gif import AUTO_FRAMES, Slide, auto_stride, frame_steps, pool_moments
from kvscope.frontend.export.replayed import busiest_step, replay
from kvscope.frontend.palette import BLOCK_COLORS, PHASE_COLORS, request_color
from tests.test_export import pressure, read_png  # noqa: F401 (the fixture: a real trace with preemptions)


def colors_in(image: Image.Image) -> set[tuple[int, int, int]]:
    return {color for _, color in image.convert("RGB").getcolors(maxcolors=1 << 24)}  # Pillow counts them in C


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(round(255 * v) for v in to_rgb(color))


def test_a_gif_has_a_frame_per_stride_and_the_pages_colours(pressure, tmp_path):
    path, events = pressure
    last = replay(events).last
    out = render(events, "timeline", tmp_path / "run.gif", stride=4)
    with Image.open(out) as gif:
        assert gif.n_frames == len(range(0, last + 1, 4)) + (last % 4 != 0) == len(frame_steps(0, last, 4))
        assert gif.info["loop"] == 0
        seen = set()
        for index in range(gif.n_frames):  # requests own blocks mid-run, phases fill the timeline by the end
            gif.seek(index)
            assert gif.size == SLIDE_SIZE == (1920, 1080)
            seen |= colors_in(gif)
    for color in (PHASE_COLORS["prefill"], PHASE_COLORS["decode"], PHASE_COLORS["preempted"], BLOCK_COLORS["free"],
                  request_color(0), request_color(1)):
        assert rgb(color) in seen, color


def test_without_a_stride_a_long_run_is_sampled_down_to_the_frame_cap():
    assert auto_stride(0, 73) == 1 and len(frame_steps(0, 73, auto_stride(0, 73))) == 74
    assert auto_stride(0, 199) == 3 and len(frame_steps(0, 199, 3)) == 68 <= AUTO_FRAMES
    assert frame_steps(0, 199, auto_stride(0, 199))[-1] == 199  # the end is always shown


def test_each_frame_shows_the_pool_and_timeline_as_of_its_iteration(pressure):
    """Drawn once, updated per frame: what each frame shows is what a replay stopped there holds."""
    _, events = pressure
    run = replay(events)
    slide, steps = Slide(run, SLIDE_SIZE), [0, 9, 23, run.last]
    moments = pool_moments(events, steps, run)
    for step in steps:
        at = replay(events, step)
        assert moments[step] == pool_cells(at.state, request_colors(run), run.order)
        slide.show(step, moments[step])
        bars = [path.vertices for c in slide.timeline.bars.values() for path in c.get_paths()]
        assert max(v[:, 0].max() for v in bars) == step + 1  # cut at the frame's iteration
        assert f"step {step} of {run.last}" in slide.step.get_text()
        finished = [v for v in at.state.requests.values() if v.finish_step is not None]
        assert len(slide.timeline.finish_marks.get_offsets()) == len(finished)


def test_cli_writes_a_gif_with_a_stride(pressure, tmp_path, capsys):
    path, events = pressure
    out = tmp_path / "run.gif"
    assert main(["export", str(path), "--out", str(out), "--stride", "10"]) in (0, None)
    assert "block pool and timeline, animated" in capsys.readouterr().out
    with Image.open(out) as gif:
        assert gif.n_frames == len(frame_steps(0, replay(events).last, 10))


def test_a_stride_below_one_is_one_line_and_exit_2(pressure, tmp_path, capsys):
    path, _ = pressure
    assert main(["export", str(path), "--out", str(tmp_path / "run.gif"), "--stride", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kvscope export: --stride 0: must be at least 1 (frames every N iterations)"


def test_the_block_pool_still_defaults_to_the_busiest_iteration(pressure, tmp_path):
    _, events = pressure
    busiest = busiest_step(events)
    used = {e["step"]: e["kv_blocks_used"] for e in events if e["type"] == "iteration"}
    assert used[busiest] == max(used.values()) and busiest < max(used)
    default = read_png(render(events, "blocks", tmp_path / "default.png"))
    chosen = read_png(render(events, "blocks", tmp_path / "chosen.png", step=busiest))
    assert np.array_equal(default, chosen)
    with Image.open(tmp_path / "default.png") as png:  # and it says so: not a step picked in silence
        assert f"step {busiest} of {max(used)}, the peak" in png.info["Title"]


def test_the_gif_replays_the_events_a_fixed_number_of_times_whatever_its_frames(pressure, tmp_path, monkeypatch):
    """Linear in the frames: the replay for the timeline, then one pass that takes each frame's pool as
    it reaches that frame's iteration; never a replay from event 0 per frame."""
    _, events = pressure
    applied = []
    apply = RunState.apply
    monkeypatch.setattr(RunState, "apply", lambda state, event: applied.append(event) or apply(state, event))
    counts = {}
    for stride in (1, 10):
        applied.clear()
        render(events, "blocks", tmp_path / f"every-{stride}.gif", stride=stride, size=(480, 270))
        counts[stride] = len(applied)
    assert len(frame_steps(0, replay(events).last, 1)) > 20
    assert counts[1] == counts[10] <= 2 * len(events)
