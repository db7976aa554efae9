"""The timeline picture: a row per request, its waiting, prefill, decode, verify and preempted stretches,
and (n > 1, beam search) the request's sequences as a tree inside its row, as the page draws them; a
tensor-parallel run's all-reduce band above them (each step outlined, rank 0's share of it in the sums filled).

TimelineArtists draws the axes, legend and (empty) shapes once from the whole run and `show`s the run
as of any iteration: the still shows its last, the GIF every frame's, without drawing the rest again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from kvscope.backend.events.state import SeqView
from kvscope.frontend.export.figure import Size, engine_facts, every_nth_label, frame, legend_outside
from kvscope.frontend.export.options import SLIDE_SIZE
from kvscope.frontend.export.replayed import ExportedRun, segments
from kvscope.frontend.palette import ALLREDUCE_COLOR, FLASH_COLORS, FOCUS_COLOR, PHASE_COLORS, RECOMPUTE_COLOR

FIRST_TOKEN_COLOR, ABORT_COLOR = "#111111", "#d62728"
# The page's beam tree (static/kvscope.js branchLine): dark lines, a red × where a beam was pruned.
BRANCH_COLOR, PRUNED_COLOR = FOCUS_COLOR, FLASH_COLORS["evict"]
BAR_HEIGHT = 0.7
MARK_PT = 12  # markers of 16+ px at 1080p (1 pt = 1.39 px)
BAND_ROW, BAND_LABEL = -1, "all-reduce"  # the band's row, above the first request's
PHASE_LABELS = {"waiting": "waiting (queued)", "prefill": "prefill chunk", "decode": "decode (1 token / step)",
                "verify": "verify (speculative, k + 1 tokens)", "preempted": "preempted (recompute)",
                "recompute": "recompute (no KV cache: whole context / step)"}


@dataclass
class Branch:
    """One sequence of a multi-sequence request: its lane in the row, where it forked and how it ended."""

    y: float  # its lane
    parent_y: float | None  # its parent's lane (None: the request's first sequence)
    start: int  # the iteration it forked at (the root: its request's arrival)
    end: int  # one past its last iteration
    end_step: int | None  # when it ended (None: still going at the end of the record)
    pruned: bool


def branches(run: ExportedRun, rows: dict[str, int]) -> list[Branch]:
    """Every sequence of the requests with several, in lanes of their request's row (the page's order:
    by fork step, then id), each linked to its parent's lane."""
    by_request: dict[str, list[SeqView]] = {}
    for view in run.state.sequences.values():
        by_request.setdefault(view.request_id, []).append(view)
    out = []
    for rid, seqs in by_request.items():
        if len(seqs) < 2 or rid not in rows:
            continue
        seqs.sort(key=lambda v: (v.start_step, v.seq_id))
        lane = {v.seq_id: rows[rid] - BAR_HEIGHT / 2 + BAR_HEIGHT * (i + 0.5) / len(seqs) for i, v in enumerate(seqs)}
        request = run.state.requests.get(rid)
        done = request.finish_step if request is not None and request.finish_step is not None else run.last
        for v in seqs:
            end = v.end_step if v.end_step is not None else done
            out.append(Branch(lane[v.seq_id], lane.get(v.parent_seq_id), max(v.start_step, run.first), end + 1,
                              v.end_step, v.end_reason == "pruned"))
    return out


class TimelineArtists:
    """The timeline on `ax` for the whole of `run`; `show(step)` draws it as it was after `step`.
    `axis_px`: the axes' height in pixels, which decides how many row labels fit."""

    def __init__(self, ax: Axes, run: ExportedRun, seconds: bool = False, axis_px: float = 800) -> None:
        self.run, self.seconds, self.rows = run, seconds, run.order
        rows = {rid: y for y, rid in enumerate(self.rows)}
        self.segments = {kind: [] for kind in PHASE_COLORS}  # kind -> (start, end, row), iterations
        for rid, y in rows.items():
            for seg in segments(run, rid):
                self.segments[seg.kind].append((seg.start, seg.end, y))
        self.bars = {kind: ax.add_collection(PolyCollection([], facecolors=PHASE_COLORS[kind],
                                                            **_bar_style(kind, len(run.batches))))
                     for kind, items in self.segments.items() if items}
        views = [run.state.requests[r] for r in self.rows]
        self.ttft = [(v.first_token_step, y) for y, v in enumerate(views) if v.first_token_step is not None]
        self.done = [(v.finish_step, y, v.finish_reason == "abort") for y, v in enumerate(views)
                     if v.finish_step is not None]
        self.branches = branches(run, rows)
        self.band = allreduce_shares(run)
        self._marks(ax)
        _timeline_axes(ax, run, self.rows, seconds, axis_px, bool(self.branches), bool(self.band))

    def _marks(self, ax: Axes) -> None:
        size = MARK_PT**2
        self.ttft_marks = ax.scatter([], [], marker="D", s=size * 0.6, color=FIRST_TOKEN_COLOR, edgecolor="white",
                                     linewidth=1, zorder=5)
        self.finish_marks = ax.scatter([], [], marker="|", s=size * 1.6, color="black", linewidth=3, zorder=5)
        self.abort_marks = ax.scatter([], [], marker="x", s=size, color=ABORT_COLOR, linewidth=3, zorder=5)
        self.lanes = ax.add_collection(LineCollection([], colors=BRANCH_COLOR, linewidths=2.2, zorder=4))
        self.ends = ax.scatter([], [], marker="o", s=size * 0.45, color=BRANCH_COLOR, zorder=6)
        self.prunes = ax.scatter([], [], marker="X", s=size * 1.3, color=PRUNED_COLOR, edgecolor="white",
                                 linewidth=1, zorder=7)
        self.band_steps = ax.add_collection(PolyCollection([], facecolors="none", edgecolors=ALLREDUCE_COLOR,
                                                           alpha=0.35, linewidths=1))
        self.band_shares = ax.add_collection(PolyCollection([], facecolors=ALLREDUCE_COLOR, linewidths=0))

    @property
    def artists(self) -> list:
        """What changes from one iteration to the next."""
        return [*self.bars.values(), self.lanes, self.ttft_marks, self.finish_marks, self.abort_marks, self.ends,
                self.prunes, self.band_steps, self.band_shares]

    def x(self, boundary: int) -> float:
        return self.run.at(boundary, self.seconds)

    def show(self, step: int) -> None:
        """Everything up to the end of iteration `step`; later stretches are cut at that boundary."""
        now = step + 1
        for kind, bars in self.bars.items():
            bars.set_verts([self._rect(start, min(end, now), y) for start, end, y in self.segments[kind] if start < now])
        self._points(self.ttft_marks, [(self.x(s + 1), y) for s, y in self.ttft if s < now])
        self._points(self.finish_marks, [(self.x(s + 1), y) for s, y, aborted in self.done if s < now and not aborted])
        self._points(self.abort_marks, [(self.x(s + 1), y) for s, y, aborted in self.done if s < now and aborted])
        shown = [b for b in self.branches if b.start < now]
        lines = [[(self.x(b.start), b.y), (self.x(min(b.end, now)), b.y)] for b in shown]
        lines += [[(self.x(b.start), b.parent_y), (self.x(b.start), b.y)] for b in shown if b.parent_y is not None]
        self.lanes.set_segments(lines)
        ended = [b for b in shown if b.end_step is not None and b.end_step < now]
        self._points(self.prunes, [(self.x(b.end), b.y) for b in ended if b.pruned])
        self._points(self.ends, [(self.x(b.end), b.y) for b in ended if not b.pruned])
        shown_band = [(step, share) for step, share in self.band if step < now]
        self.band_steps.set_verts([self._rect(step, step + 1, BAND_ROW) for step, _ in shown_band])
        self.band_shares.set_verts([self._rect(step, step + 1, BAND_ROW, share) for step, share in shown_band])

    def _rect(self, start: int, end: int, y: float, share: float = 1.0) -> list[tuple[float, float]]:
        """The bar from boundary `start` to `end`, or its first `share` (the all-reduce band's fill)."""
        x0, h = self.x(start), BAR_HEIGHT / 2
        x1 = x0 + share * (self.x(end) - x0)
        return [(x0, y - h), (x1, y - h), (x1, y + h), (x0, y + h)]

    @staticmethod
    def _points(marks: Any, points: list[tuple[float, float]]) -> None:
        marks.set_offsets(np.array(points, dtype=float).reshape(-1, 2))


def allreduce_shares(run: ExportedRun) -> list[tuple[int, float]]:
    """(iteration, the share of its recorded time rank 0 spent in all-reduces) of a tensor-parallel run's
    iterations, as the page's band draws them (frontend/views/timeline.py); [] for one process."""
    return [(e["step"], min(1.0, e["allreduce"]["ms"] / (1000 * e["duration_s"])) if e["duration_s"] > 0 else 0.0)
            for e in run.events if e["type"] == "iteration" and e.get("allreduce") and e["step"] <= run.last]


def draw_timeline(run: ExportedRun, seconds: bool = False, size: Size = SLIDE_SIZE) -> Figure:
    rows = run.order
    subtitle = (f"{len(rows)} requests · {len(run.batches)} iterations · "
                f"{run.state.num_preemptions} preemptions · {engine_facts(run)}")
    fig, (ax,) = frame(run, "Timeline", subtitle, size)
    TimelineArtists(ax, run, seconds, axis_px=0.78 * size[1]).show(run.last)
    return fig


def _bar_style(kind: str, num_iterations: int) -> dict[str, Any]:
    """White edges between prefill chunks (while they are wide enough to see); a hatch for preempted."""
    if kind == "preempted":
        return {"hatch": "xx", "edgecolor": RECOMPUTE_COLOR, "linewidth": 0}
    if kind == "prefill" and num_iterations <= 200:
        return {"edgecolor": "white", "linewidth": 1}
    return {"linewidth": 0}


def _timeline_axes(ax: Axes, run: ExportedRun, rows: list[str], seconds: bool, axis_px: float,
                   tree: bool, band: bool) -> None:
    ax.set_ylim(len(rows) - 0.4, BAND_ROW * band - 0.6)
    every = every_nth_label(len(rows), axis_px)
    ax.set_yticks([BAND_ROW] * band + list(range(0, len(rows), every)), [BAND_LABEL] * band + rows[::every])
    ax.set_ylabel("request (arrival order)" + (f", every {every}th named" if every > 1 else ""))
    left, right = run.at(run.first, seconds), run.at(run.last + 1, seconds)
    ax.set_xlim(left, right + 0.015 * (right - left))  # room for the last finish mark
    ax.set_xlabel("seconds since the run started" if seconds else "engine iteration (step)")
    if not seconds:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    handles = phase_handles(run) + [
        Line2D([], [], marker="D", color=FIRST_TOKEN_COLOR, markeredgecolor="white", ls="", markersize=9,
               label="first token (TTFT)"),
        Line2D([], [], marker="|", color="black", markersize=16, mew=3, ls="", label="finished")]
    if any(run.state.requests[r].finish_reason == "abort" for r in rows):
        handles.append(Line2D([], [], marker="x", color=ABORT_COLOR, mew=3, ls="", markersize=12, label="aborted"))
    if tree:
        handles += tree_handles()
    if band:
        handles.append(Patch(facecolor=ALLREDUCE_COLOR, label="all-reduce: rank 0's share of the step"))
    legend_outside(ax, handles)


def tree_handles() -> list[Line2D]:
    """The beam tree's legend: a lane per sequence, forks linked to the parent, the two ends."""
    return [Line2D([], [], color=BRANCH_COLOR, lw=2.2, label="a sequence (beam); a fork links to its parent"),
            Line2D([], [], marker="o", color=BRANCH_COLOR, ls="", markersize=8, label="sequence finished"),
            Line2D([], [], marker="X", color=PRUNED_COLOR, markeredgecolor="white", ls="", markersize=14,
                   label="beam pruned")]


def phase_handles(run: ExportedRun) -> list[Patch]:
    """A legend patch per phase in the run (waiting, prefill and decode always, recompute instead of decode
    without a KV cache; verify and preempted when seen)."""
    seen = {phase for per in run.batches.values() for phase, _ in per.values()}
    always = ("waiting", "prefill", "decode" if run.state.kv_cache else "recompute")
    shown = [k for k in PHASE_LABELS if k in always or k in seen or (k == "preempted" and run.state.num_preemptions)]
    return [Patch(facecolor=PHASE_COLORS[k], label=PHASE_LABELS[k],
                  **({"hatch": "xx", "edgecolor": RECOMPUTE_COLOR} if k == "preempted" else {})) for k in shown]
