"""render(): one view of a run, written as PNG, SVG or (the timeline) Perfetto JSON; or the run as a GIF."""

from __future__ import annotations

import json
from pathlib import Path

from kvscope.frontend.export.batch import draw_batch
from kvscope.frontend.export.blocks import draw_blocks
from kvscope.frontend.export.figure import Size, slide_style
from kvscope.frontend.export.gif import Progress, write_gif
from kvscope.frontend.export.options import SLIDE_SIZE, check_options
from kvscope.frontend.export.perfetto import perfetto_trace
from kvscope.frontend.export.replayed import Event, busiest_step, replay
from kvscope.frontend.export.timeline import draw_timeline

DRAW = {"timeline": draw_timeline, "blocks": draw_blocks, "batch": draw_batch}


def render(events: list[Event], view: str, out_path: str | Path, *, x: str = "steps", step: int | None = None,
           stride: int | None = None, size: Size = SLIDE_SIZE, progress: Progress | None = None) -> Path:
    """Write `view` of the run in `events` to out_path; the suffix picks png, svg, json or gif.

    Pictures are `size` pixels (16:9 at 1920×1080 by default). A .gif is the block pool above the
    timeline, a frame every `stride` iterations (default: every one, sampled down to gif.AUTO_FRAMES),
    whatever the view. The block pool's still picture defaults to the busiest iteration (at the end
    the pool is free). `progress(fraction)` hears how far it got, from 0 to 1."""
    out_path = Path(out_path)
    check_options(view, out_path, x, stride)
    if out_path.suffix.lower() == ".gif":
        return write_gif(events, out_path, stride, size, progress)
    if progress is not None:
        progress(0.0)
    if view == "blocks" and step is None:
        step = busiest_step(events)
    run = replay(events, step)
    if out_path.suffix.lower() == ".json":
        out_path.write_text(json.dumps(perfetto_trace(run)), encoding="utf-8")
    else:
        with slide_style():
            fig = DRAW[view](run, seconds=x == "seconds", size=size)
            fig.savefig(out_path, dpi=fig.dpi, metadata={"Title": fig.get_suptitle()})
    if progress is not None:
        progress(1.0)
    return out_path
