"""render(): one view of a run, written as PNG, SVG or (the timeline) Perfetto JSON; or the run as a GIF."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from kvscope.frontend.export.batch import draw_batch
from kvscope.frontend.export.blocks import draw_blocks
from kvscope.frontend.export.figure import DPI
from kvscope.frontend.export.gif import write_gif
from kvscope.frontend.export.options import check_options
from kvscope.frontend.export.perfetto import perfetto_trace
from kvscope.frontend.export.replayed import Event, busiest_step, replay
from kvscope.frontend.export.timeline import draw_timeline

DRAW = {"timeline": draw_timeline, "blocks": draw_blocks, "batch": draw_batch}


def render(events: list[Event], view: str, out_path: str | Path, *, x: str = "steps", step: int | None = None,
           stride: int = 1) -> Path:
    """Write `view` of the run in `events` to out_path; the suffix picks png, svg, json or gif.

    A .gif is the block pool above the timeline, a frame every `stride` iterations (any view). The
    block pool's still picture defaults to the busiest iteration (at the end the pool is free)."""
    out_path = Path(out_path)
    check_options(view, out_path, x, stride)
    if out_path.suffix.lower() == ".gif":
        return write_gif(events, out_path, stride)
    if view == "blocks" and step is None:
        step = busiest_step(events)
    run = replay(events, step)
    if out_path.suffix.lower() == ".json":
        out_path.write_text(json.dumps(perfetto_trace(run)), encoding="utf-8")
        return out_path
    fig = DRAW[view](run, seconds=x == "seconds")
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: searchable, smaller
        fig.savefig(out_path, dpi=DPI, metadata={"Title": fig.get_suptitle()})
    return out_path
