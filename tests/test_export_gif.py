"""The animated GIF for slides, and the block pool still at the busiest iteration."""

from __future__ import annotations

import numpy as np
from matplotlib.colors import to_rgb
from PIL import Image

from kvscope.cli import main
from kvscope.frontend.export import render
from kvscope.frontend.export.gif import frame_steps
from kvscope.frontend.export.replayed import busiest_step, replay
from kvscope.frontend.palette import BLOCK_COLORS, PHASE_COLORS, request_color
from tests.test_export import pressure, read_png  # noqa: F401 (the fixture: a real trace with preemptions)


def colors_in(image: Image.Image) -> set[tuple[int, int, int]]:
    return {tuple(int(v) for v in c) for c in np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)}


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
            seen |= colors_in(gif)
    for color in (PHASE_COLORS["prefill"], PHASE_COLORS["decode"], PHASE_COLORS["preempted"], BLOCK_COLORS["free"],
                  request_color(0), request_color(1)):
        assert rgb(color) in seen, color


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
