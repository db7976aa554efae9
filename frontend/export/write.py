"""render(): one view of a run, written as PNG, SVG or (the timeline) Perfetto JSON; the run as a GIF; a lesson
moment as a picture; or the lesson as an HTML handout."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from kvscope.frontend.export.draw import DRAW
from kvscope.frontend.export.figure import Size, slide_style
from kvscope.frontend.export.gif import Progress, write_gif
from kvscope.frontend.export.handout import write_handout
from kvscope.frontend.export.lesson import draw_page, moment_page
from kvscope.frontend.export.options import SLIDE_SIZE, check_options
from kvscope.frontend.export.perfetto import perfetto_trace
from kvscope.frontend.export.replayed import Event, busiest_step, replay


def render(events: list[Event], view: str, out_path: str | Path, *, x: str = "steps", step: int | None = None,
           stride: int | None = None, size: Size = SLIDE_SIZE, moment: str | None = None,
           progress: Progress | None = None) -> Path:
    """Write `view` of the run in `events` to out_path; the suffix picks png, svg, json, gif or html.

    Pictures are `size` pixels (16:9 at 1920×1080 by default). A .gif is the block pool above the
    timeline, a frame every `stride` iterations (default: every one, sampled down to gif.AUTO_FRAMES),
    whatever the view. The block pool's still picture defaults to the busiest iteration (at the end
    the pool is free), and its title then says so. The view "moment" is the lesson step that pauses at
    the `moment` kind, as a picture (export/lesson.py); "handout" (.html) is the whole lesson
    (export/handout.py). `progress(fraction)` hears how far it got, from 0 to 1."""
    out_path = Path(out_path)
    check_options(view, out_path, x, stride, moment)
    suffix = out_path.suffix.lower()
    if suffix == ".gif":
        return write_gif(events, out_path, stride, size, progress)
    if suffix == ".html":
        return write_handout(events, out_path, size, progress)
    if progress is not None:
        progress(0.0)
    if suffix == ".json":
        out_path.write_text(json.dumps(perfetto_trace(replay(events, step))), encoding="utf-8")
    else:
        with slide_style():
            fig = _figure(events, view, x, step, size, moment)
            fig.savefig(out_path, dpi=fig.dpi, metadata={"Title": fig.get_suptitle()})
    if progress is not None:
        progress(1.0)
    return out_path


def _figure(events: list[Event], view: str, x: str, step: int | None, size: Size, moment: str | None) -> Figure:
    if view == "moment":
        return draw_page(events, moment_page(events, moment), size)
    if view == "blocks" and step is None:
        step = busiest_step(events)
    return DRAW[view](replay(events, step), seconds=x == "seconds", size=size)
