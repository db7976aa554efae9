"""The timeline picture: a row per request, its waiting, prefill, decode, verify and preempted stretches."""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from kvscope.frontend.export.figure import engine_facts, frame, legend_outside
from kvscope.frontend.export.replayed import ExportedRun, segments
from kvscope.frontend.palette import PHASE_COLORS, RECOMPUTE_COLOR

FIRST_TOKEN_COLOR, ABORT_COLOR = "#111111", "#d62728"
PHASE_LABELS = {"waiting": "waiting (queued)", "prefill": "prefill chunk", "decode": "decode (1 token / step)",
                "verify": "verify (speculative, k + 1 tokens)", "preempted": "preempted (recompute)",
                "recompute": "recompute (no KV cache: whole context / step)"}


def draw_timeline(run: ExportedRun, seconds: bool = False) -> Figure:
    rows = run.order
    subtitle = (f"{len(rows)} requests · {len(run.batches)} iterations · "
                f"{run.state.num_preemptions} preemptions · {engine_facts(run)}")
    fig, (ax,) = frame(run, "Timeline", subtitle, (13, min(24, max(5.5, 2.2 + 0.32 * len(rows)))))
    bars: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in PHASE_COLORS}
    for y, rid in enumerate(rows):
        for seg in segments(run, rid):
            x0 = run.at(seg.start, seconds)
            bars[seg.kind].append((x0, run.at(seg.end, seconds) - x0, y))
    for kind, items in bars.items():
        if items:
            x0s, widths, ys = zip(*items)
            ax.barh(ys, widths, left=x0s, height=0.7, color=PHASE_COLORS[kind], **_bar_style(kind, len(run.batches)))
    _timeline_marks(ax, run, rows, seconds)
    _timeline_axes(ax, run, rows, seconds)
    return fig


def _bar_style(kind: str, num_iterations: int) -> dict[str, Any]:
    """White edges between prefill chunks (while they are wide enough to see); a hatch for preempted."""
    if kind == "preempted":
        return {"hatch": "xx", "edgecolor": RECOMPUTE_COLOR, "linewidth": 0}
    if kind == "prefill" and num_iterations <= 200:
        return {"edgecolor": "white", "linewidth": 0.6}
    return {"linewidth": 0}


def _timeline_marks(ax: Axes, run: ExportedRun, rows: list[str], seconds: bool) -> None:
    """First token (end of the iteration that sampled it) and finish markers."""
    views = [run.state.requests[r] for r in rows]
    ttft = [(run.at(v.first_token_step + 1, seconds), y) for y, v in enumerate(views) if v.first_token_step is not None]
    done = [(run.at(v.finish_step + 1, seconds), y, v.finish_reason == "abort")
            for y, v in enumerate(views) if v.finish_step is not None]
    if ttft:
        ax.scatter(*zip(*ttft), marker="D", s=22, color=FIRST_TOKEN_COLOR, edgecolor="white", linewidth=0.5,
                   zorder=3)
    for aborted, marker, color in ((False, "|", "black"), (True, "x", ABORT_COLOR)):
        pts = [(x, y) for x, y, a in done if a == aborted]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, s=120, color=color, linewidth=2, zorder=3)


def _timeline_axes(ax: Axes, run: ExportedRun, rows: list[str], seconds: bool) -> None:
    ax.set_ylim(len(rows) - 0.4, -0.6)
    if len(rows) <= 60:
        ax.set_yticks(range(len(rows)), rows, fontsize=9 if len(rows) <= 30 else 7)
    ax.set_ylabel("request (arrival order)")
    left, right = run.at(run.first, seconds), run.at(run.last + 1, seconds)
    ax.set_xlim(left, right + 0.015 * (right - left))  # room for the last finish mark
    ax.set_xlabel("seconds since the run started" if seconds else "engine iteration (step)")
    if not seconds:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    handles = phase_handles(run) + [
        Line2D([], [], marker="D", color=FIRST_TOKEN_COLOR, markeredgecolor="white", ls="", label="first token (TTFT)"),
        Line2D([], [], marker="|", color="black", markersize=12, mew=2, ls="", label="finished")]
    if any(run.state.requests[r].finish_reason == "abort" for r in rows):
        handles.append(Line2D([], [], marker="x", color=ABORT_COLOR, mew=2, ls="", label="aborted"))
    legend_outside(ax, handles)


def phase_handles(run: ExportedRun) -> list[Patch]:
    """A legend patch per phase in the run (waiting, prefill and decode always, recompute instead of decode
    without a KV cache; verify and preempted when seen)."""
    seen = {phase for per in run.batches.values() for phase, _ in per.values()}
    always = ("waiting", "prefill", "decode" if run.state.kv_cache else "recompute")
    shown = [k for k in PHASE_LABELS if k in always or k in seen or (k == "preempted" and run.state.num_preemptions)]
    return [Patch(facecolor=PHASE_COLORS[k], label=PHASE_LABELS[k],
                  **({"hatch": "xx", "edgecolor": RECOMPUTE_COLOR} if k == "preempted" else {})) for k in shown]
