"""Timeline: a row per request over iterations (waiting, prefill chunks, decode, preempted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nicegui import ui
from nicegui.events import EChartPointClickEventArguments

from kvscope.backend.events.state import RunState, SeqView
from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.backend.events.history import KIND_RANK, KINDS, Cell, Column
from kvscope.frontend.grammar_position import tagged
from kvscope.frontend.hardware import HardwareChoice
from kvscope.frontend.selection import Selection
from kvscope.frontend.palette import ALLREDUCE_COLOR, KIND_LABELS, PHASE_COLORS, TRANSFER_COLOR
from kvscope.frontend.views.base import INTEGER_LABELS, FeedView, Js, legend, legend_html, view_card
from kvscope.frontend.views.charts import make_chart
from kvscope.frontend.views.chunks import Chunks

EXPLANATION = """
One row per request, one column per engine **iteration** (one forward pass over the whole batch).
A request **waits** in the queue (grey) until the scheduler admits it, then **prefills** its prompt
(orange; a long prompt is split into *chunks* over several iterations when chunked prefill is on)
and **decodes** one token per iteration (blue). When the KV cache runs out of blocks the newest
request is **preempted** (red): its blocks are freed and it waits to recompute its prefix later.
The diamond marks its **first token**: the time to first token (TTFT) is the distance from the row's
start to it. With speculative decoding a request **verifies** (purple) several drafted tokens per
iteration. A request with several sequences (parallel sampling with n > 1, beam search) shows them
as thin lines inside its row: each **fork** branches from its parent at the iteration it happened
(hover: at which token), a pruned beam ends in a ×, a finished sequence in a dot. Scroll or drag
the sliders to zoom; switch the x axis between iterations, seconds (the recorded engine time) and
seconds **modelled** on the hardware picked above the views: each iteration's batch priced by the
roofline cost model (see the roofline chart), as if this run had been served there.

A **tensor-parallel** run (the model split over ranks) has an **all-reduce** band above the requests:
every layer ends its attention and its MLP by summing the ranks' partial outputs, and the filled part
of each step's outline is the time rank 0 spent in those sums (waiting for the slower rank included).
Hover it for the milliseconds, the count and the bytes. The modelled axis leaves it out: it was measured here.

A **disaggregated** run (prefill and decode on instances of their own) has a row per instance above the
requests: each step's outline, filled by the share of it that instance spent working (orange a prefill
instance, blue a decode instance), each on its own clock. A request's **move** is the teal triangle in
its row: the iteration its KV blocks went from its prefill instance to its decode instance, between
its prefill and its first decode (hover: the blocks, the bytes, the link's time).
"""

CELL_SERIES = {
    "type": "custom", "renderItem": Js("kvscope.timelineCell"), "encode": {"x": [0, 1], "y": 2},
    "clip": True, "animation": False,
}  # fmt: skip


BRANCH_SERIES = {
    "id": "branches", "type": "custom", "renderItem": Js("kvscope.branchLine"), "encode": {"x": [0, 1], "y": 2},
    "clip": True, "animation": False, "z": 4,
}  # fmt: skip
BAND_SERIES = {
    "type": "custom", "renderItem": Js("kvscope.allreduceCell"), "encode": {"x": [0, 1], "y": 2},
    "clip": True, "animation": False, "z": 3,
}  # fmt: skip
INSTANCE_SERIES = {
    "type": "custom", "renderItem": Js("kvscope.instanceCell"), "encode": {"x": [0, 1], "y": 2},
    "clip": True, "animation": False, "z": 3,
}  # fmt: skip
BAND_LABEL = "all-reduce"  # the band's row, first on the y axis
END_MARK = {None: 0, "pruned": 2}  # anything else ended normally (1)


def legend_items(kv_cache: bool = True, allreduce: bool = False, moves: bool = False) -> list[tuple[str, str]]:
    """(colour, label) of the timeline's legend: the phases (recompute instead of decode without a
    KV cache), the all-reduce band of a tensor-parallel run, then the marks (a disaggregated run's moves)."""
    hidden = "recompute" if kv_cache else "decode"
    phases = [(PHASE_COLORS[kind], label) for kind, label in KIND_LABELS.items() if kind != hidden]
    band = [(ALLREDUCE_COLOR, "all-reduce: rank 0's share of the step")] if allreduce else []
    move = [(TRANSFER_COLOR, "▶ KV moved to its decode instance")] if moves else []
    return [*phases, *band, ("#111", "◆ first token · ─ sequences (n > 1, beams)"), *move]


def request_cells(cells: list[Cell]) -> list[Cell]:
    """One cell per request: its sequences (n > 1, beams) share the request's row."""
    out: dict[str, Cell] = {}
    for cell in cells:
        seen = out.get(cell.request_id)
        if seen is not None:
            kind = max(seen.kind, cell.kind, key=KIND_RANK.__getitem__)
            cell = Cell(cell.request_id, kind, seen.tokens + cell.tokens)
        out[cell.request_id] = cell
    return list(out.values())


Clock = Callable[[Column], tuple[float, float]]  # a column's (seconds at its end, its duration)


def recorded_clock(col: Column) -> tuple[float, float]:
    """The iteration as it was recorded: its end in seconds since the start, its own duration."""
    return col.t, col.duration_s


def column_span(col: Column, clock: Clock | None) -> tuple[float, float]:
    """An iteration's extent on x: its own duration by `clock`, else one unit centred on its step."""
    if clock is None:
        return col.step - 0.5, col.step + 0.5
    t, duration = clock(col)
    return t - duration, t


def column_items(col: Column, prev_t: float | None, rows: dict[str, int], clock: Clock | None) -> list[list[Any]]:
    """Data items [x0, x1, row, kind, tokens, step, request_id] of one iteration; x in iterations, or
    in seconds by `clock` (a waiting cell spans the gap since the previous iteration too)."""
    items = []
    x0, x1 = column_span(col, clock)
    for cell in request_cells(col.cells):
        waiting = clock is not None and prev_t is not None and cell.kind in ("waiting", "preempted")
        row = rows.get(cell.request_id)
        if row is not None:
            items.append([round(prev_t if waiting else x0, 4), round(x1, 4), row, KINDS.index(cell.kind), cell.tokens,
                          col.step, cell.request_id])
    return items


def allreduce_item(col: Column, clock: Clock | None) -> list[Any] | None:
    """[x0, x1, row, share, ms, step, count, bytes, step ms] of a tensor-parallel step's all-reduces (row 0, the
    band's): the share of the step (its recorded duration) that rank 0 spent in them; None for a step without any."""
    if col.allreduce is None:
        return None
    x0, x1 = column_span(col, clock)
    step_ms = 1000 * col.duration_s
    ms = col.allreduce["ms"]
    share = min(1.0, ms / step_ms) if step_ms > 0 else 0.0
    return [round(x0, 4), round(x1, 4), 0, round(share, 4), ms, col.step, col.allreduce["count"],
            col.allreduce["bytes"], round(step_ms, 2)]


def instance_items(col: Column, roles: list[str], clock: Clock | None) -> list[list[Any]]:
    """[x0, x1, row, share, ms, step, tokens, running, role (its KINDS index: prefill or decode), instance] of each
    disaggregated instance in one step (rows 0.., the instances'): the share of the step it spent working, on its
    own clock."""
    if not col.instances:
        return []
    x0, x1 = column_span(col, clock)
    step_s = col.duration_s
    return [[round(x0, 4), round(x1, 4), i["instance"], round(min(1.0, i["duration_s"] / step_s), 4) if step_s > 0 else 0,
             round(1000 * i["duration_s"], 2), col.step, i["num_batched_tokens"], i["num_running"],
             KINDS.index(roles[i["instance"]]), i["instance"]] for i in col.instances if i["instance"] < len(roles)]


def transfer_items(state: RunState, rows: dict[str, int], x_of: dict[int, float] | None) -> list[list[Any]]:
    """[x, row, request_id, what] of each request's move between disaggregated instances, at its iteration."""
    items = []
    for rid, view in state.requests.items():
        moved = view.transfer
        if moved is None or rid not in rows:
            continue
        x = _x(moved["step"], x_of, 0.5)
        if x is None:
            continue
        what = (f"{len(moved['src_blocks'])} blocks, {moved['bytes'] / 1024:,.1f} KiB, instance {moved['src_instance']}"
                f" → {moved['dst_instance']} in {1000 * moved['link_s']:.2f} ms")
        items.append([x, rows[rid], rid, what])
    return items


def merge_runs(items: list[list[Any]]) -> list[list[Any]]:
    """Consecutive iterations of one request in the same phase become one rectangle.

    64 decoding requests over a chunk of 16 iterations are 64 shapes instead of 1,024: the browser
    repaints every shape of a chart whenever anything in it changes."""
    merged: list[list[Any]] = []
    last: dict[int, list[Any]] = {}  # row -> its open run
    for item in sorted(items, key=lambda it: (it[2], it[5])):
        run = last.get(item[2])
        if run is not None and run[3] == item[3] and run[7] + 1 == item[5]:
            run[1], run[4], run[7] = item[1], run[4] + item[4], item[5]
            continue
        run = [*item, item[5]]  # + the run's last iteration
        merged.append(run)
        last[item[2]] = run
    return merged


def row_labels(rows: dict[str, int], selected: str | None, state: RunState | None = None) -> list:
    """The y axis: one label per request, the selected one marked (every view highlights it), a request
    under structured outputs tagged with its grammar's kind."""
    mark = {"fontWeight": "bold", "backgroundColor": "#fde68a", "padding": [1, 3]}
    views = state.requests if state is not None else {}
    names = {rid: tagged(rid, views[rid].sampling) if rid in views else rid for rid in rows}
    return [{"value": names[rid], "textStyle": mark} if rid == selected else names[rid] for rid in rows]


def branch_items(state: RunState, rows: dict[str, int], x_of: dict[int, float] | None) -> list[list[Any]]:
    """[x0, x1, row, slot, slots, parent slot (-1: root), end mark, seq, request, position, reason, parent]
    for every sequence of a multi-sequence request; x in iterations, or seconds through `x_of`."""
    by_request: dict[str, list[SeqView]] = {}
    for view in state.sequences.values():
        by_request.setdefault(view.request_id, []).append(view)
    items = []
    for rid, seqs in by_request.items():
        if len(seqs) < 2 or rid not in rows:
            continue
        seqs.sort(key=lambda v: (v.start_step, v.seq_id))
        slot = {v.seq_id: i for i, v in enumerate(seqs)}
        request = state.requests.get(rid)
        done = request.finish_step if request is not None and request.finish_step is not None else state.step
        for v in seqs:
            x0, x1 = _x(v.start_step, x_of, -0.5), _x(v.end_step if v.end_step is not None else done, x_of, 0.5)
            if x0 is None or x1 is None:
                continue
            items.append([x0, x1, rows[rid], slot[v.seq_id], len(seqs), slot.get(v.parent_seq_id, -1),
                          END_MARK.get(v.end_reason, 1), v.seq_id, rid, v.position, v.end_reason or "",
                          v.parent_seq_id])
    return items


def _x(step: int, x_of: dict[int, float] | None, edge: float) -> float | None:
    """An iteration's left (edge -0.5) or right (+0.5) boundary, or in seconds the time it ended."""
    if x_of is None:
        return step + edge
    t = x_of.get(step)
    return round(t, 4) if t is not None else None


class TimelineView(FeedView):
    name = "timeline"

    def __init__(self, feed: RunFeed, selection: Selection, hardware: HardwareChoice, height: str = "300px") -> None:
        self.selection = selection
        self.hardware = hardware
        self.axis = "iterations"  # or "seconds" (recorded), or "modelled" (on the chosen hardware)
        self.clock: Clock | None = None  # the clock of the current drawing (None: iterations)
        self.chunks = Chunks("tl-", build=merge_runs)
        self.band_chunks = Chunks("ar-")  # the all-reduce band's items, one per step (no two are alike)
        self.band = False  # a tensor-parallel run's all-reduce band is drawn (first row)
        self.instance_chunks = Chunks("in-")  # a disaggregated run's instance rows, one item per instance a step
        self.roles: list[str] = []  # a disaggregated run's instances' roles: a row each, first
        self.transfers_sent: list = []
        self.last_step = -10**9
        self.last_t: float | None = None
        self.rows_sent = 0
        self.ttft_sent: list = []
        self.branches_sent: list = []
        self.labels_sent: list = []
        self.step_t: dict[int, float] = {}
        with view_card("Timeline: requests over iterations", EXPLANATION, "w-full"):
            with ui.row().classes("items-center gap-3"):
                self.legend = legend(legend_items())
                ui.space()
                self.axis_toggle = ui.toggle(self._axis_options(), value=self.axis,
                                             on_change=lambda e: self.set_axis(e.value)) \
                    .props("dense size=sm").mark("timeline-axis")
            self.chart = make_chart(self._options(), height, "timeline")
        self.chart.on_point_click(self._on_click)
        selection.on_change(self.invalidate)
        hardware.on_change(self._on_hardware)
        super().__init__(feed)

    def _options(self) -> dict:
        return {
            "grid": {"left": 84, "right": 36, "top": 8, "bottom": 66},  # the axis name clear of the slider at 16 px
            "tooltip": {"trigger": "item", ":formatter": "kvscope.timelineTip"},
            "xAxis": {"type": "value", "name": "iteration", "nameLocation": "middle", "nameGap": 26,
                      "min": "dataMin", "max": "dataMax", "axisLabel": {"fontSize": 11, **INTEGER_LABELS}},
            "yAxis": {"type": "category", "data": [], "inverse": True, "axisLabel": {"fontSize": 11}},
            "dataZoom": [
                {"type": "slider", "xAxisIndex": 0, "filterMode": "weakFilter", "height": 16, "bottom": 4,
                 "showDataShadow": False},
                {"type": "inside", "xAxisIndex": 0, "filterMode": "weakFilter"},
                {"type": "slider", "yAxisIndex": 0, "filterMode": "weakFilter", "width": 12, "right": 6,
                 "showDataShadow": False},
            ],
            "series": [],
        }

    def _axis_options(self) -> dict[str, str]:
        return {"iterations": "iterations", "seconds": "seconds", "modelled": f"modelled on {self.hardware.name}"}

    def set_axis(self, axis: str) -> None:
        self.axis = axis
        self.invalidate()

    def _on_hardware(self) -> None:
        self.axis_toggle.set_options(self._axis_options(), value=self.axis)
        if self.axis == "modelled":
            self.invalidate()

    def _choose_clock(self) -> Clock | None:
        """The x axis' clock for a full redraw: recorded seconds, modelled seconds, or None (iterations)."""
        if self.axis == "seconds":
            return recorded_clock
        run = self.hardware.modelled() if self.axis == "modelled" else None
        return run.clock if run is not None else None

    # -- drawing ---------------------------------------------------------------------------------

    def full(self) -> bool:
        state = self.feed.state
        self.clock = self._choose_clock()
        # measured time has no place on the modelled axis: the cost model prices its own communication
        self.band = state.tensor_parallel is not None and self.axis != "modelled"
        self.roles = [i["role"] for i in state.instances]
        self.legend.set_content(legend_html(legend_items(state.kv_cache, self.band, bool(self.roles))))
        self.chunks.clear()
        self.band_chunks.clear()
        self.instance_chunks.clear()
        self.transfers_sent = []
        self.step_t = {}
        self.last_step, self.last_t, self.rows_sent, self.ttft_sent, self.branches_sent = -10**9, None, 0, [], []
        self._add_columns(self.feed.history.columns)
        option = self._axes(force=True)
        option["series"] = [{**CELL_SERIES, "id": sid, "data": data} for sid, data in self.chunks.all()]
        option["series"] += [{**BAND_SERIES, "id": sid, "data": data} for sid, data in self.band_chunks.all()]
        option["series"] += [{**INSTANCE_SERIES, "id": sid, "data": data} for sid, data in self.instance_chunks.all()]
        option["series"].append(self._ttft_series(force=True) or {"id": "ttft", "type": "scatter", "data": []})
        option["series"].append(self._transfer_series(force=True))
        option["series"].append(self._branch_series(force=True))
        self.push(self.chart, option, replace_series=True)
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        columns = self.feed.history.columns
        new = [c for c in columns[-len(entries):] if c.step > self.last_step] if entries else []
        if new and self.axis == "modelled":
            self.hardware.modelled()  # prices the new iterations before the clock reads them
        self._add_columns(new)
        option = self._axes()
        series = [{**CELL_SERIES, "id": sid, "data": data} for sid, data in self.chunks.take_dirty()]
        series += [{**BAND_SERIES, "id": sid, "data": data} for sid, data in self.band_chunks.take_dirty()]
        series += [{**INSTANCE_SERIES, "id": sid, "data": data} for sid, data in self.instance_chunks.take_dirty()]
        series += [extra for extra in (self._ttft_series(), self._branch_series(), self._transfer_series()) if extra]
        if series:
            option["series"] = series
        if not option:
            return False
        self.push(self.chart, option)
        return True

    def top_labels(self) -> list[str]:
        """The rows above the requests: the all-reduce band, or a disaggregated run's instances."""
        return [BAND_LABEL] * self.band + [f"{role} {i}" for i, role in enumerate(self.roles)]

    def rows(self) -> dict[str, int]:
        """Each request's row on the y axis: its arrival order, after the rows above the requests."""
        rows, above = self.feed.history.rows, len(self.top_labels())
        return {rid: row + above for rid, row in rows.items()} if above else rows

    def _add_columns(self, columns: list[Column]) -> None:
        rows = self.rows()
        for col in columns:
            if col.step <= self.last_step:
                continue
            for item in column_items(col, self.last_t, rows, self.clock):
                self.chunks.add(col.step, item)
            band = allreduce_item(col, self.clock) if self.band else None
            if band is not None:
                self.band_chunks.add(col.step, band)
            for item in instance_items(col, self.roles, self.clock):
                self.instance_chunks.add(col.step, item)
            t = self.clock(col)[0] if self.clock is not None else col.t
            self.last_step, self.last_t = col.step, t
            self.step_t[col.step] = t

    def _axes(self, force: bool = False) -> dict:
        option: dict = {}
        rows = self.feed.history.rows
        if force or len(rows) != self.rows_sent:
            self.rows_sent = len(rows)
            self.labels_sent = self.top_labels() + row_labels(rows, self.selection.request_id, self.feed.state)
            option["yAxis"] = {"data": self.labels_sent}
        if force:
            label = Js("kvscope.seconds") if self.clock is not None else Js(INTEGER_LABELS[":formatter"])
            option["xAxis"] = {"name": self.axis_name(), "axisLabel": {"formatter": label}}
        return option

    def axis_name(self) -> str:
        """The x axis' title: what its numbers are, and on which hardware when modelled."""
        if self.axis == "seconds":
            simulated = " (simulated: modelled when recorded)" if self.feed.state.simulated else ""
            return f"seconds since start{simulated}"
        if self.axis == "modelled":
            if self.clock is None:
                return f"iteration ({self.hardware.problem() or 'cannot model this run'})"
            return f"seconds modelled on {self.hardware.label}"
        return "iteration"

    def _ttft_series(self, force: bool = False) -> dict | None:
        state, history, rows = self.feed.state, self.feed.history, self.rows()
        t_of = self.step_t if self.clock is not None else None
        data = []
        for rid, view in state.requests.items():
            if view.first_token_step is None or rid not in rows:
                continue
            x = t_of.get(view.first_token_step) if t_of is not None else view.first_token_step
            if x is None:
                continue
            seconds = history.engine_ttft(view.arrival_step, view.first_token_step)
            ttft = f"{seconds * 1000:.0f} ms of engine time" if seconds is not None else \
                f"{view.first_token_step - view.arrival_step} iterations after arrival"
            data.append([round(x, 4), rows[rid], rid, ttft])
        if not force and data == self.ttft_sent:
            return None
        self.ttft_sent = data
        return {"id": "ttft", "type": "scatter", "data": data, "symbol": "diamond", "symbolSize": Js("kvscope.markPx"),
                "encode": {"x": 0, "y": 1}, "itemStyle": {"color": "#111"}, "z": 5}

    def _transfer_series(self, force: bool = False) -> dict | None:
        data = transfer_items(self.feed.state, self.rows(), self.step_t if self.clock is not None else None)
        if not force and data == self.transfers_sent:
            return None
        self.transfers_sent = data
        return {"id": "transfers", "type": "scatter", "data": data, "symbol": "triangle", "symbolRotate": -90,
                "symbolSize": Js("kvscope.markPx"), "encode": {"x": 0, "y": 1}, "itemStyle": {"color": TRANSFER_COLOR},
                "z": 5}

    def _branch_series(self, force: bool = False) -> dict | None:
        data = branch_items(self.feed.state, self.rows(), self.step_t if self.clock is not None else None)
        if not force and data == self.branches_sent:
            return None
        self.branches_sent = data
        return {**BRANCH_SERIES, "data": data}

    def _on_click(self, e: EChartPointClickEventArguments) -> None:
        value = e.value if isinstance(e.value, list) else (e.data or {}).get("value", [])
        rid = value[6] if len(value) > 6 else (value[2] if len(value) > 2 else None)
        if isinstance(rid, str):
            self.selection.select_request(rid)
