"""What every picture shares: the figure frame, request colours and legends."""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kvscope.frontend.export.replayed import ExportedRun
from kvscope.frontend.palette import request_color

DPI = 110
MAX_LEGEND_REQUESTS = 14


def request_colors(run: ExportedRun) -> dict[str, str]:
    """Each request's colour: its timeline row (arrival order) into the palette, as on the page."""
    return {rid: request_color(run.history.rows.get(rid, i)) for i, rid in enumerate(run.order)}


def frame(run: ExportedRun, view: str, subtitle: str, size: tuple[float, float], rows: int = 1,
          **kw: Any) -> tuple[Figure, list[Axes]]:
    """A figure with the view and run as its title and one line of facts under it."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False, **kw)[:, 0].tolist()
    fig.suptitle(f"{view} · {run.title}", fontsize=14, fontweight="bold")
    axes[0].set_title(subtitle, fontsize=10, loc="left", color="#444444")
    return fig, axes


def legend_outside(ax: Axes, handles: list, title: str | None = None, gap: float = 0.01) -> None:
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 + gap, 1.0), fontsize=9, title=title,
              title_fontsize=9, frameon=False)


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
