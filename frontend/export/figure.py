"""What every picture shares: a 16:9 slide-sized figure, its title, request colours and legends.

A picture is laid out on a 19.2-inch-wide page whatever its pixel size: the DPI scales it, so a
1280×720 export is the 1920×1080 one made smaller, and every font size below reads as at 1080p
(100 px per inch: 12 pt = 16.7 px, the smallest text a room can read from the back).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvscope.frontend.export.options import SLIDE_SIZE
from kvscope.frontend.export.replayed import ExportedRun
from kvscope.frontend.palette import request_color

PAGE_WIDTH_IN = 19.2  # 1920 px at 100 px per inch
MIN_TEXT_PT = 12  # 16.7 px at 1080p
MAX_LEGEND_REQUESTS = 14
SLIDE_RC = {"font.size": 14, "axes.titlesize": 15, "axes.labelsize": 15, "xtick.labelsize": 14,
            "ytick.labelsize": 14, "legend.fontsize": 14, "legend.title_fontsize": 14,
            "figure.titlesize": 24, "svg.fonttype": "none"}  # svg: text stays text (searchable, smaller)
TITLE_PT, SUBTITLE_PT = 24, 15

Size = tuple[int, int]


@contextmanager
def slide_style() -> Iterator[None]:
    """Fonts for a room: matplotlib reads some sizes when it draws, so drawing and saving go inside."""
    with matplotlib.rc_context(SLIDE_RC):
        yield


def slide_figure(size: Size = SLIDE_SIZE) -> Figure:
    """An empty figure of exactly `size` pixels (width × height) when saved at its own DPI."""
    width, height = size
    dpi = width / PAGE_WIDTH_IN
    return Figure(figsize=(PAGE_WIDTH_IN, height / dpi), dpi=dpi, layout="constrained")


def request_colors(run: ExportedRun) -> dict[str, str]:
    """Each request's colour: its timeline row (arrival order) into the palette, as on the page."""
    return {rid: request_color(run.history.rows.get(rid, i)) for i, rid in enumerate(run.order)}


def title(run: ExportedRun, view: str, step_note: str = "") -> str:
    """'Timeline · memory-pressure · step 30 of 73 · model demo': what a slide says it shows; `step_note`
    says why that step ('the peak')."""
    note = f", {step_note}" if step_note else ""
    return f"{view} · {run.scenario} · {step_label(run.last, run)}{note} · model {run.model_name}"


def step_label(step: int, run: ExportedRun) -> str:
    return f"step {step} of {run.trace_last}" + (" (end)" if step == run.trace_last else "")


def frame(run: ExportedRun, view: str, subtitle: str, size: Size = SLIDE_SIZE, rows: int = 1, step_note: str = "",
          **kw: Any) -> tuple[Figure, list[Axes]]:
    """A slide with the view, run and step as its title and one line of facts under it."""
    fig = slide_figure(size)
    axes = fig.subplots(rows, 1, squeeze=False, **kw)[:, 0].tolist()
    fig.suptitle(title(run, view, step_note), fontsize=TITLE_PT, fontweight="bold")
    axes[0].set_title(subtitle, fontsize=SUBTITLE_PT, loc="left", color="#444444")
    return fig, axes


def legend_outside(ax: Axes, handles: list, title: str | None = None, gap: float = 0.01, ncols: int = 1) -> None:
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 + gap, 1.0), title=title, frameon=False,
              alignment="left", ncols=ncols)


def request_handles(colors: dict[str, Any], ids: list[str], suffix: dict[str, str] | None = None) -> list:
    """Legend patches for up to MAX_LEGEND_REQUESTS requests, then a '+N more' line."""
    suffix = suffix or {}
    shown = [Patch(color=colors[r], label=f"{r}{suffix.get(r, '')}") for r in ids[:MAX_LEGEND_REQUESTS]]
    if len(ids) > MAX_LEGEND_REQUESTS:
        shown.append(Patch(color="white", label=f"+{len(ids) - MAX_LEGEND_REQUESTS} more requests"))
    return shown


def engine_facts(run: ExportedRun) -> str:
    c = run.state.config
    return (f"{c.get('batching', '?')} batching · budget {c.get('max_num_batched_tokens', '?')} tokens · "
            f"max {c.get('max_num_seqs', '?')} seqs")


def every_nth_label(count: int, axis_px: float, label_px: float = 24.0) -> int:
    """Show every n-th of `count` row labels so that labels of 16+ px never overlap in axis_px."""
    return max(1, -(-int(count * label_px) // max(1, int(axis_px))))
