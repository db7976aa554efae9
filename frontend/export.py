"""Pictures of a run from its events alone: the timeline, block pool and batch views as PNG or SVG
(matplotlib's Agg and SVG renderers, no browser), and the timeline as a Chrome/Perfetto trace.

Shared by `kvscope export` and the dashboard's export button. The state (block tables, requests)
comes from RunState, the one reducer; the past a view needs (which request ran, waited or sat
preempted at which iteration) from RunHistory, as in the live dashboard, so that an exported
timeline shows what the page showed. See docs/export.md.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from backend.events.state import RunState
from backend.events.history import RunHistory

Event = dict[str, Any]
VIEWS = ("timeline", "blocks", "batch")
FORMATS = (".png", ".svg", ".json")
X_UNITS = ("steps", "seconds")
DPI = 110
PHASE_COLORS = {"waiting": "#d4d4d4", "prefill": "#4c78a8", "decode": "#59a14f", "verify": "#b07aa1",
                "preempted": "#f4a6a6"}
# A request whose sequences are in different phases in one iteration shows the highest ranked one.
PHASE_RANK = {"decode": 0, "verify": 1, "prefill": 2}
PREEMPT_HATCH = "#d35f5f"
FREE_COLOR, CACHED_COLOR = "#efefef", "#9a9a9a"
IDLE_COLOR, IDLE_WAITING_COLOR, WAITING_COLOR = "#f1f1f1", "#f6c6c6", "#e15759"
MAX_LEGEND_REQUESTS = 14


class ExportError(ValueError):
    """Bad export input; `field` names what to fix: view, out, x, step or trace."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass
class Run:
    """The events up to the chosen step, replayed, plus the per-iteration history views draw."""

    events: list[Event]
    state: RunState
    history: RunHistory
    order: list[str]  # ids of the requests not rejected, in arrival order (their color index)
    batches: dict[int, dict[str, tuple[str, int]]]  # iteration -> request -> (phase, query tokens)
    ran: dict[str, list[int]]  # request -> the iterations it was in, ascending
    starts: dict[int, float]  # iteration -> t when it started
    end_t: float  # t when the last iteration ended
    last: int  # the last iteration

    @property
    def title(self) -> str:
        scenario = (self.state.scenario or {}).get("name") or f"run {self.state.run_id}"
        return f"{scenario} · model {Path(str(self.state.model.get('name', '?'))).name}"

    def at(self, boundary: int, seconds: bool) -> float:
        """x of the boundary before iteration `boundary`: the step number, or when it started."""
        if not seconds:
            return float(boundary)
        return self.starts.get(boundary, self.end_t if boundary > self.last else self.starts[self.last])


@dataclass
class Segment:
    kind: str  # waiting | prefill | decode | verify | preempted
    start: int  # first iteration
    end: int  # one past the last iteration
    tokens: int = 0


# ---- entry points ------------------------------------------------------------------------------


def check_options(view: str, out_path: Path, x: str = "steps") -> None:
    """Raise ExportError for an unknown view, format or x unit, or a missing output folder."""
    if view not in VIEWS:
        raise ExportError("view", f"not a view (use {', '.join(VIEWS)})")
    if out_path.suffix.lower() not in FORMATS:
        raise ExportError("out", f"unknown format {out_path.suffix or '(none)'!r} (use .png, .svg or .json)")
    if out_path.suffix.lower() == ".json" and view != "timeline":
        raise ExportError("view", "a .json export is the timeline as a Perfetto trace; use .png or .svg")
    if x not in X_UNITS:
        raise ExportError("x", f"not an x unit (use {' or '.join(X_UNITS)})")
    if not out_path.parent.is_dir():
        raise ExportError("out", f"the folder {str(out_path.parent)!r} does not exist")


def render(events: list[Event], view: str, out_path: str | Path, *, x: str = "steps", step: int | None = None) -> Path:
    """Write `view` of the run in `events` to out_path; the suffix picks png, svg or json."""
    out_path = Path(out_path)
    check_options(view, out_path, x)
    run = replay(events, step)
    if out_path.suffix.lower() == ".json":
        out_path.write_text(json.dumps(perfetto_trace(run)), encoding="utf-8")
        return out_path
    fig = {"timeline": draw_timeline, "blocks": draw_blocks, "batch": draw_batch}[view](run, seconds=x == "seconds")
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: searchable, smaller
        fig.savefig(out_path, dpi=DPI, metadata={"Title": fig.get_suptitle()})
    return out_path


def replay(events: list[Event], step: int | None = None) -> Run:
    """Apply the events (those of iterations up to `step`, if given) to a fresh RunState."""
    if not events or events[0].get("type") != "header":
        raise ExportError("trace", "the first event must be a header")
    iterations = [e for e in events if e["type"] == "iteration"]
    if not iterations:
        raise ExportError("trace", "no iteration events to draw (recorded with engine.events=off?)")
    if step is not None and not 0 <= step <= iterations[-1]["step"]:
        raise ExportError("step", f"{step} is outside the trace's iterations 0..{iterations[-1]['step']}")
    if step is not None:
        events = [e for e in events if e["step"] <= step]
        iterations = [e for e in iterations if e["step"] <= step]
    state, history = RunState(max_iterations=len(iterations)), RunHistory()
    for event in events:
        state.apply(event)
        history.apply(event, state)
    batches = _batches(history)
    ran: dict[str, list[int]] = {}
    for step in sorted(batches):
        for rid in batches[step]:
            ran.setdefault(rid, []).append(step)
    order = [rid for rid, view in state.requests.items() if view.status != "rejected"]
    return Run(events, state, history, order, batches, ran,
               {it["step"]: it["t"] - it["duration_s"] for it in iterations}, iterations[-1]["t"],
               iterations[-1]["step"])


def _batches(history: RunHistory) -> dict[int, dict[str, tuple[str, int]]]:
    """Per iteration, per request: its phase (prefill wins over its other sequences', then verify) and tokens."""
    out: dict[int, dict[str, tuple[str, int]]] = {}
    for column in history.columns:
        per = out.setdefault(column.step, {})
        for cell in column.scheduled:
            phase, tokens = per.get(cell.request_id, (cell.kind, 0))
            per[cell.request_id] = (max(phase, cell.kind, key=PHASE_RANK.__getitem__), tokens + cell.tokens)
    return out


# ---- shared: colors and the figure frame ---------------------------------------------------------


def request_colors(order: list[str]) -> dict[str, Any]:
    """A stable color per request: its arrival index into one palette (no greys: those mean free/cached)."""
    cmaps = matplotlib.colormaps
    palette = [c for i, c in enumerate(cmaps["tab10"].colors) if i != 7]
    palette += list(cmaps["tab20b"].colors) + list(cmaps["tab20c"].colors[:16])
    return {rid: palette[i % len(palette)] for i, rid in enumerate(order)}


def frame(run: Run, view: str, subtitle: str, size: tuple[float, float], rows: int = 1,
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


def engine_facts(run: Run) -> str:
    c = run.state.config
    return (f"{c.get('batching', '?')} batching · budget {c.get('max_num_batched_tokens', '?')} tokens · "
            f"max {c.get('max_num_seqs', '?')} seqs")


# ---- timeline ----------------------------------------------------------------------------------


def segments(run: Run, rid: str) -> list[Segment]:
    """One request's [start, end) iteration ranges: waiting, prefill chunks, decode runs, preempted gaps.

    Read from RunHistory's columns (the live timeline's cells): each prefill chunk is its own
    segment; consecutive waiting, preempted, decode or verify iterations merge into one."""
    segs: list[Segment] = []
    for column in run.history.columns:
        kind, tokens = run.batches[column.step].get(rid) or next(
            ((c.kind, 0) for c in column.cells if c.request_id == rid), (None, 0))
        if kind is None:
            continue
        last = segs[-1] if segs else None
        if kind != "prefill" and last and last.kind == kind and last.end == column.step:
            last.end, last.tokens = column.step + 1, last.tokens + tokens
        else:
            segs.append(Segment(kind, column.step, column.step + 1, tokens))
    return segs


def draw_timeline(run: Run, seconds: bool = False) -> Figure:
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
        return {"hatch": "xx", "edgecolor": PREEMPT_HATCH, "linewidth": 0}
    if kind == "prefill" and num_iterations <= 200:
        return {"edgecolor": "white", "linewidth": 0.6}
    return {"linewidth": 0}


def _timeline_marks(ax: Axes, run: Run, rows: list[str], seconds: bool) -> None:
    """First token (end of the iteration that sampled it) and finish markers."""
    views = [run.state.requests[r] for r in rows]
    ttft = [(run.at(v.first_token_step + 1, seconds), y) for y, v in enumerate(views) if v.first_token_step is not None]
    done = [(run.at(v.finish_step + 1, seconds), y, v.finish_reason == "abort")
            for y, v in enumerate(views) if v.finish_step is not None]
    if ttft:
        ax.scatter(*zip(*ttft), marker="D", s=22, color="#f28e2b", edgecolor="black", linewidth=0.5, zorder=3)
    for aborted, marker, color in ((False, "|", "black"), (True, "x", "#d62728")):
        pts = [(x, y) for x, y, a in done if a == aborted]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, s=120, color=color, linewidth=2, zorder=3)


def _timeline_axes(ax: Axes, run: Run, rows: list[str], seconds: bool) -> None:
    ax.set_ylim(len(rows) - 0.4, -0.6)
    if len(rows) <= 60:
        ax.set_yticks(range(len(rows)), rows, fontsize=9 if len(rows) <= 30 else 7)
    ax.set_ylabel("request (arrival order)")
    left, right = run.at(0, seconds), run.at(run.last + 1, seconds)
    ax.set_xlim(left, right + 0.015 * (right - left))  # room for the last finish mark
    ax.set_xlabel("seconds since the run started" if seconds else "engine iteration (step)")
    if not seconds:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    handles = [Patch(color=PHASE_COLORS["waiting"], label="waiting (queued)"),
               Patch(color=PHASE_COLORS["prefill"], label="prefill chunk"),
               Patch(color=PHASE_COLORS["decode"], label="decode (1 token / step)"),
               Line2D([], [], marker="D", color="#f28e2b", markeredgecolor="black", ls="", label="first token (TTFT)"),
               Line2D([], [], marker="|", color="black", markersize=12, mew=2, ls="", label="finished")]
    if any(seg_phase == "verify" for per in run.batches.values() for seg_phase, _ in per.values()):
        handles.insert(3, Patch(color=PHASE_COLORS["verify"], label="verify (speculative, k + 1 tokens)"))
    if run.state.num_preemptions:
        handles.insert(3, Patch(facecolor=PHASE_COLORS["preempted"], hatch="xx", edgecolor=PREEMPT_HATCH,
                                label="preempted (recompute)"))
    if any(run.state.requests[r].finish_reason == "abort" for r in rows):
        handles.append(Line2D([], [], marker="x", color="#d62728", mew=2, ls="", label="aborted"))
    legend_outside(ax, handles)


# ---- blocks ------------------------------------------------------------------------------------


def grid_columns(num_blocks: int) -> int:
    for cols, limit in ((8, 32), (16, 256), (32, 1024), (64, 8192)):
        if num_blocks <= limit:
            return cols
    return 64 * math.ceil(math.sqrt(2 * num_blocks) / 64)


def block_owners(run: Run) -> dict[int, str]:
    """In-use block -> the earliest-arrived request among its owners."""
    rank = {rid: i for i, rid in enumerate(run.order)}
    owners = {}
    for block, seqs in run.state.block_owner.items():
        rids = [run.state.seq_request[s] for s in seqs if s in run.state.seq_request]
        if rids:
            owners[block] = min(rids, key=lambda r: rank.get(r, len(rank)))
    return owners


def draw_blocks(run: Run, seconds: bool = False) -> Figure:
    state, n = run.state, run.state.num_blocks
    cols = grid_columns(n)
    rows = math.ceil(n / cols)
    colors, owners = request_colors(run.order), block_owners(run)
    free, cached = set(state.free_blocks) - state.cached_blocks, state.cached_blocks
    shared = sorted(b for b, count in state.ref_counts.items() if count > 1)
    subtitle = (f"at step {run.last}{' (end of trace)' if state.finished else ''} · {n} blocks × "
                f"{state.cache.get('block_size', '?')} tokens · {n - len(free) - len(cached)} in use · "
                f"{len(cached)} cached · {len(free)} free · {len(shared)} shared")
    fig, (ax,) = frame(run, "KV block pool", subtitle, (13, min(14, max(4.5, 1.8 + rows * 9 / cols))))
    cell_colors = {**{b: colors.get(r, "black") for b, r in owners.items()},
                   **dict.fromkeys(free, FREE_COLOR), **dict.fromkeys(cached, CACHED_COLOR)}
    image = [[to_rgb("white")] * cols for _ in range(rows)]  # [rows, cols, rgb]; the tail of the last row stays white
    for block in range(n):
        image[block // cols][block % cols] = to_rgb(cell_colors.get(block, "black"))
    ax.imshow(image, interpolation="nearest", aspect="equal")
    _block_marks(ax, image, n, shared)
    _block_axes(ax, cols, rows)
    _block_legend(ax, colors, owners, run.order, len(free), len(cached))
    return fig


def _block_legend(ax: Axes, colors: dict[str, Any], owners: dict[int, str], order: list[str], free: int,
                  cached: int) -> None:
    per_request = Counter(owners.values())
    in_use = [r for r in order if r in per_request]
    handles = [Patch(facecolor=FREE_COLOR, edgecolor="#bbbbbb", label=f"free ({free})"),
               Patch(color=CACHED_COLOR, label=f"cached, evictable ({cached})"),
               Line2D([], [], marker="o", color="black", markeredgecolor="white", ls="",
                      label="shared (ref count > 1)")]
    counts = {r: f" ({per_request[r]} in use)" for r in in_use}
    legend_outside(ax, handles + request_handles(colors, in_use, counts), title="blocks")


def _block_marks(ax: Axes, image: list[list[tuple]], num_blocks: int, shared: list[int]) -> None:
    """A dot on shared blocks; block ids written in the cells while there are few."""
    cols = len(image[0])
    size = max(4, 260 / cols)
    if shared:
        ax.scatter([b % cols for b in shared], [b // cols for b in shared], s=size, color="black",
                   edgecolor="white", linewidth=0.6, zorder=3)
    if num_blocks <= 128:
        for block in range(num_blocks):
            r, g, b = image[block // cols][block % cols]
            ink = "#222222" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"
            ax.text(block % cols, block // cols + 0.3, str(block), ha="center", va="center", fontsize=7, color=ink)


def _block_axes(ax: Axes, cols: int, rows: int) -> None:
    ax.set_xticks([c - 0.5 for c in range(cols + 1)], minor=True)
    ax.set_yticks([r - 0.5 for r in range(rows + 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5 if cols <= 16 else 0.5)
    ax.tick_params(which="minor", length=0)
    step_x, step_y = max(1, cols // 16), max(1, rows // 16)
    ax.set_xticks(range(0, cols, step_x), [str(c) for c in range(0, cols, step_x)])
    ax.set_yticks(range(0, rows, step_y), [str(r * cols) for r in range(0, rows, step_y)])
    ax.set_xlabel("block id − row start (column)")
    ax.set_ylabel("row start block id")
    for spine in ax.spines.values():
        spine.set_visible(False)


# ---- batch -------------------------------------------------------------------------------------


def draw_batch(run: Run, seconds: bool = False) -> Figure:
    subtitle = f"{len(run.batches)} iterations · {engine_facts(run)}"
    fig, (tok_ax, seq_ax) = frame(run, "Batch composition", subtitle, (13, 7.5), rows=2, sharex=True,
                                  height_ratios=[3, 1.3])
    steps = sorted(run.batches)
    width = 0.8 if len(steps) <= 150 else 1.0
    colors = request_colors(run.order)
    for (rid, phase), (xs, hs, bs) in _token_stacks(run).items():
        prefill = phase == "prefill"
        tok_ax.bar(xs, hs, bottom=bs, width=width, color=colors[rid], alpha=0.55 if prefill else 1.0,
                   hatch="////" if prefill else None, edgecolor=colors[rid] if prefill else "none", linewidth=0)
    budgets = [it["token_budget"] for it in run.state.iterations]
    tok_ax.plot([it["step"] for it in run.state.iterations], budgets, drawstyle="steps-mid", color="black",
                linestyle="--", linewidth=1.2)
    tok_ax.set_ylabel("tokens in the iteration")
    tok_ax.set_ylim(0, max(budgets) * 1.08)
    scheduled = [r for r in run.order if r in run.ran]
    handles = [Patch(facecolor="#bbbbbb", hatch="////", edgecolor="#555555", label="prefill tokens"),
               Patch(color="#555555", label="decode tokens"),
               Line2D([], [], color="black", linestyle="--", label="token budget")]
    legend_outside(tok_ax, handles + request_handles(colors, scheduled), title="tokens by request", gap=0.05)
    _slots(seq_ax, run)
    return fig


def _token_stacks(run: Run) -> dict[tuple[str, str], tuple[list[int], list[int], list[int]]]:
    """(request, phase) -> the x, height and bottom of its bars, stacked in arrival order per iteration."""
    rank = {rid: i for i, rid in enumerate(run.order)}
    stacks: dict[tuple[str, str], tuple[list[int], list[int], list[int]]] = {}
    for step, per in run.batches.items():
        bottom = 0
        for rid in sorted(per, key=lambda r: rank.get(r, len(rank))):
            phase, tokens = per[rid]
            xs, hs, bs = stacks.setdefault((rid, phase), ([], [], []))
            xs.append(step), hs.append(tokens), bs.append(bottom)
            bottom += tokens
    return stacks


def _slots(ax: Axes, run: Run) -> None:
    """Sequences in the batch, the idle slots up to max_num_seqs, and the waiting queue."""
    its = list(run.state.iterations)
    steps = [it["step"] for it in its]
    sizes = [len(it["batch"]) for it in its]
    cap = run.state.config.get("max_num_seqs") or max(sizes)
    idle = [max(0, cap - s) for s in sizes]
    idle_colors = [IDLE_WAITING_COLOR if it["num_waiting"] else IDLE_COLOR for it in its]
    width = 0.8 if len(steps) <= 150 else 1.0
    ax.bar(steps, sizes, width=width, color="#6b6b6b")
    ax.bar(steps, idle, bottom=sizes, width=width, color=idle_colors, hatch="..", edgecolor="#c8c8c8", linewidth=0)
    ax.set_ylabel("sequences")
    ax.set_xlabel("engine iteration (step)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    ax.set_xlim(min(steps) - 0.6, max(steps) + 0.6)
    _waiting_line(ax, steps, [it["num_waiting"] for it in its])
    legend_outside(ax, [Patch(color="#6b6b6b", label="sequences in the batch"),
                        Patch(facecolor=IDLE_COLOR, hatch="..", edgecolor="#c8c8c8", label=f"idle slots (of {cap})"),
                        Patch(facecolor=IDLE_WAITING_COLOR, hatch="..", edgecolor="#c8c8c8",
                              label="idle while requests wait"),
                        Line2D([], [], color=WAITING_COLOR, label="waiting requests (right axis)")], gap=0.05)


def _waiting_line(ax: Axes, steps: list[int], waiting: list[int]) -> None:
    """The queue on its own (right) axis: it can be far longer than max_num_seqs."""
    twin = ax.twinx()
    twin.plot(steps, waiting, drawstyle="steps-mid", color=WAITING_COLOR, linewidth=1.5)
    twin.set_ylim(0, max(1, max(waiting)) * 1.1)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    twin.set_ylabel("waiting", color=WAITING_COLOR)
    twin.tick_params(axis="y", colors=WAITING_COLOR)


# ---- Perfetto / Chrome trace -------------------------------------------------------------------


def perfetto_trace(run: Run) -> dict[str, Any]:
    """The timeline in Chrome's trace event format: one thread per request, times in microseconds."""
    out = [_meta("process_name", 0, f"kvscope · {run.title}"), _meta("thread_name", 0, "engine iterations"),
           _meta("thread_sort_index", 0, 0)]
    for it in run.state.iterations:
        out.append(_span(0, f"step {it['step']}", it["t"] - it["duration_s"], it["t"],
                         {"batch_size": len(it["batch"]), "num_batched_tokens": it["num_batched_tokens"],
                          "token_budget": it["token_budget"], "num_waiting": it["num_waiting"]}))
        out.append({"ph": "C", "name": "kv_blocks_used", "pid": 1, "ts": _us(it["t"]),
                    "args": {"blocks": it["kv_blocks_used"]}})
    moments = _moments(run.events)
    for tid, rid in enumerate(run.order, start=1):
        out += [_meta("thread_name", tid, rid), _meta("thread_sort_index", tid, tid)]
        out += _request_events(run, rid, tid, moments)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"run_id": run.state.run_id, "title": run.title, "last_step": run.last}}


def _request_events(run: Run, rid: str, tid: int, moments: dict[tuple[str, str], list[Event]]) -> list[Event]:
    out = []
    arrived = moments.get(("request_arrived", rid), [])
    for seg in segments(run, rid):
        begin, end = run.at(seg.start, True), run.at(seg.end, True)
        if seg.kind == "waiting" and arrived:
            begin = min(begin, arrived[0]["t"])
        args = {"first_step": seg.start, "last_step": seg.end - 1, "tokens": seg.tokens}
        out.append(_span(tid, seg.kind, begin, end, args))
    for kind, name in (("preempt", "preempted"), ("token", "first token"), ("request_finished", "finished")):
        for e in moments.get((kind, rid), []):
            args = {"step": e["step"], **({"finish_reason": e["finish_reason"]} if kind == "request_finished" else {})}
            out.append({"ph": "i", "s": "t", "name": name, "pid": 1, "tid": tid, "ts": _us(e["t"]), "args": args})
    return out


def _moments(events: list[Event]) -> dict[tuple[str, str], list[Event]]:
    """(type, request id) -> its arrivals, preemptions, finishes, and its first token only."""
    out: dict[tuple[str, str], list[Event]] = {}
    for e in events:
        if e["type"] in ("request_arrived", "preempt", "token", "request_finished"):
            seen = out.setdefault((e["type"], e["request_id"]), [])
            if e["type"] != "token" or not seen:
                seen.append(e)
    return out


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _span(tid: int, name: str, begin: float, end: float, args: dict[str, Any]) -> Event:
    return {"ph": "X", "name": name, "cat": name, "pid": 1, "tid": tid, "ts": _us(begin),
            "dur": max(0.0, _us(end) - _us(begin)), "args": args}


def _meta(name: str, tid: int, value: str | int) -> Event:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"ph": "M", "name": name, "pid": 1, "tid": tid, "args": {key: value}}
