"""Batch composition: per iteration, the tokens of each request (prefill vs decode) and idle slots."""

from __future__ import annotations

from typing import Any

from nicegui.events import EChartPointClickEventArguments

from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.backend.events.history import Column, RunHistory
from kvscope.backend.phase import SHOWN_PHASES
from kvscope.frontend.selection import Selection
from kvscope.frontend.palette import BUDGET_COLOR, MANY_REQUESTS_COLOR, RECOMPUTE_COLOR, SLOT_COLORS, request_color
from kvscope.frontend.views.base import INTEGER_LABELS, FeedView, Js, legend, legend_html, view_card
from kvscope.frontend.views.charts import make_chart
from kvscope.frontend.views.chunks import Chunks
from kvscope.frontend.views.live_text import LiveText

EXPLANATION = """
Each bar is one iteration: how many **tokens** went through the model, stacked by request
(colours as in the timeline). A **prefill** segment (solid, outlined) is a chunk of a prompt, many
tokens at once; a **decode** segment (pale) is one token of one request. The dashed line is the
**token budget** (`max_num_batched_tokens`): the scheduler never puts more tokens into one step.
Without a KV cache (`engine.kv_cache: false`) nothing is decoded: each step **recomputes** the
whole context (solid, outlined dark red), so a request's bar grows by one token every step.
A request picked anywhere is outlined here and the others fade.

The lower strip counts **batch slots** (`max_num_seqs`): grey slots hold a sequence, red ones are
**idle**. Static batching admits a new batch only when the whole previous batch has finished, so
its slots sit idle while requests wait; continuous batching refills a slot at the next iteration.
"""

SEG_SERIES = {"type": "custom", "renderItem": Js("kvscope.batchSeg"), "encode": {"x": [0, 1], "y": [2, 3]},
              "xAxisIndex": 0, "yAxisIndex": 0, "clip": True}
SLOT_SERIES = {"type": "custom", "renderItem": Js("kvscope.slotBar"), "encode": {"x": [0, 1], "y": [2, 3]},
               "xAxisIndex": 1, "yAxisIndex": 1, "clip": True}
PHASE = {phase: i for i, phase in enumerate(SHOWN_PHASES)}  # the index kvscope.js reads back (palette.for_js)
FOCUS_NONE, FOCUS_SELECTED, FOCUS_OTHER = 0, 1, 2  # no request picked; the picked one; the rest (dimmed)


MERGED = 999  # colour index of "many decodes in one segment" (grey)
MAX_DECODE_SEGMENTS = 12  # more decoding requests than this share one segment per iteration


def column_segments(col: Column, history: RunHistory, selected: str | None = None) -> list[list[Any]]:
    """[step, y0, y1, colour, phase, request_id, tokens, focus] stacked bottom-up in batch order.

    With many decoding requests (one token each) their segments would be slivers a pixel tall and
    thousands of shapes to repaint: they are drawn as one grey segment instead (the selected
    request keeps its own). focus: FOCUS_NONE, or FOCUS_SELECTED / FOCUS_OTHER when one is picked."""
    items, y = [], 0
    cells = col.scheduled
    decodes = [c for c in cells if c.kind == "decode" and c.request_id != selected]
    if len(decodes) > MAX_DECODE_SEGMENTS:
        cells = [c for c in cells if c not in decodes]
        tokens = sum(c.tokens for c in decodes)
        items.append([col.step, 0, tokens, MERGED, PHASE["decode"], f"{len(decodes)} requests", tokens,
                      _focus(None, selected)])
        y = tokens
    for cell in cells:
        row = history.rows.get(cell.request_id, 0)
        items.append([col.step, y, y + cell.tokens, row, PHASE[cell.kind], cell.request_id, cell.tokens,
                      _focus(cell.request_id, selected)])
        y += cell.tokens
    return items[::-1]  # drawn top-down, so a thin segment's minimum height overlaps the one above it


def _focus(request_id: str | None, selected: str | None) -> int:
    if selected is None:
        return FOCUS_NONE
    return FOCUS_SELECTED if request_id == selected else FOCUS_OTHER


def legend_items(kv_cache: bool = True) -> list[tuple[str, str]]:
    """(swatch CSS, label): decode tokens, or without a KV cache the recomputed context."""
    color = request_color(0)
    computed = (f"{color}80", "decode / verify tokens (pale)") if kv_cache else \
        (f"{color};outline:2px solid {RECOMPUTE_COLOR};outline-offset:-2px", "recompute: whole context, no KV cache")
    return [(color, "prefill tokens (solid, colour = request)"), computed,
            (MANY_REQUESTS_COLOR, "many decodes in one segment"), (BUDGET_COLOR, "--- token budget"),
            (SLOT_COLORS["used"], "slot used"), (SLOT_COLORS["idle"], "slot idle")]


def merge_columns(items: list[list[Any]]) -> list[list[Any]]:
    """[step, *rest] items -> [first step, last step, *rest], consecutive equal columns merged.

    A steady stretch of decoding (the same requests, one token each) becomes one shape instead of
    one per iteration: ECharts repaints every shape of the chart on every update."""
    merged: list[list[Any]] = []
    open_runs: dict[tuple, list[Any]] = {}  # the rest of an item -> its run, if it reached the last step
    for item in sorted(items, key=lambda it: it[0]):
        key = tuple(item[1:])
        run = open_runs.get(key)
        if run is not None and run[1] + 1 == item[0]:
            run[1] = item[0]
            continue
        run = [item[0], item[0], *item[1:]]
        merged.append(run)
        open_runs[key] = run
    return merged


def column_slots(col: Column) -> list[Any] | None:
    if not col.max_num_seqs:
        return None
    return [col.step, len(col.scheduled), max(col.max_num_seqs, len(col.scheduled))]


class BatchView(FeedView):
    name = "batch"

    def __init__(self, feed: RunFeed, selection: Selection, height: str = "300px") -> None:
        self.selection = selection
        self.segments = Chunks("bt-", build=merge_columns)
        self.slots = Chunks("sl-", build=merge_columns)
        self.last_step = -10**9
        self.first_step: int | None = None
        self.budget_sent: tuple | None = None
        self.budget = 0
        self.tallest = 0  # most tokens in one iteration so far: the y scale, so decodes stay visible
        with view_card("Batch composition per iteration", EXPLANATION, "w-full"):
            self.caption = LiveText().classes("kv-caption").mark("batch-caption")
            self.legend = legend(legend_items())
            self.chart = make_chart(self._options(), height, "batch")
        self.chart.on_point_click(self._on_click)
        selection.on_change(self.invalidate)
        super().__init__(feed)

    def _options(self) -> dict:
        return {
            "grid": [{"left": 72, "right": 16, "top": 12, "bottom": "40%"},
                     {"left": 72, "right": 16, "top": "66%", "bottom": 48}],
            "tooltip": {"trigger": "item", ":formatter": "kvscope.batchTip"},
            "xAxis": [{"type": "value", "gridIndex": 0, "min": "dataMin", "max": "dataMax",
                       "axisLabel": {"show": False}},
                      {"type": "value", "gridIndex": 1, "min": "dataMin", "max": "dataMax", "name": "iteration",
                       "nameLocation": "middle", "nameGap": 20, "axisLabel": INTEGER_LABELS}],
            "yAxis": [{"type": "value", "gridIndex": 0, "name": "tokens", "nameLocation": "middle", "nameGap": 52},
                      {"type": "value", "gridIndex": 1, "name": "slots", "minInterval": 1, "nameLocation": "middle",
                       "nameGap": 52, "splitNumber": 2}],
            "dataZoom": [{"type": "slider", "xAxisIndex": [0, 1], "filterMode": "weakFilter", "height": 14,
                          "bottom": 2, "showDataShadow": False},
                         {"type": "inside", "xAxisIndex": [0, 1], "filterMode": "weakFilter"}],
            "series": [],
        }

    def full(self) -> bool:
        self.legend.set_content(legend_html(legend_items(self.feed.state.kv_cache)))
        self.segments.clear()
        self.slots.clear()
        self.last_step, self.first_step, self.budget_sent, self.tallest = -10**9, None, None, 0
        self._add(self.feed.history.columns)
        series = [{**SEG_SERIES, "id": sid, "data": d} for sid, d in self.segments.all()]
        series += [{**SLOT_SERIES, "id": sid, "data": d} for sid, d in self.slots.all()]
        series.append(self._budget(force=True) or {"id": "budget", "type": "line", "data": []})
        self.push(self.chart, {"series": series}, replace_series=True)
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        columns = self.feed.history.columns
        self._add([c for c in columns[-len(entries):] if c.step > self.last_step])
        series = [{**SEG_SERIES, "id": sid, "data": d} for sid, d in self.segments.take_dirty()]
        series += [{**SLOT_SERIES, "id": sid, "data": d} for sid, d in self.slots.take_dirty()]
        budget = self._budget()
        if budget:
            series.append(budget)
        if not series:
            return False
        self.push(self.chart, {"series": series})
        return True

    def _add(self, columns: list[Column]) -> None:
        for col in columns:
            if col.step <= self.last_step:
                continue
            if self.first_step is None:
                self.first_step = col.step
            for item in column_segments(col, self.feed.history, self.selection.request_id):
                self.segments.add(col.step, item)
            slots = column_slots(col)
            if slots:
                self.slots.add(col.step, slots)
            self.last_step = col.step
            self.budget = col.token_budget
            self.tallest = max(self.tallest, col.num_batched_tokens)

    def _fits(self) -> bool:
        """Whether the budget line goes on the chart. The token axis scales to the data, and a budget
        far above the tallest batch (2,048 tokens for decodes of 1) would flatten every bar."""
        return self.budget <= max(self.tallest, 8) * 2

    def _budget(self, force: bool = False) -> dict | None:
        """The budget line (empty when it would not fit) and the caption; None when unchanged."""
        if self.first_step is None:
            return None
        fits = self._fits()
        key = (self.first_step, self.last_step, self.budget, fits)
        if key == self.budget_sent and not force:
            return None
        self.budget_sent = key
        self.caption.set(f"token budget {self.budget} per iteration · tallest batch so far {self.tallest} tokens"
                              + ("" if fits else " (the budget line is above the chart)"))
        data = [[self.first_step - 0.5, self.budget], [self.last_step + 0.5, self.budget]] if fits else []
        return {"id": "budget", "type": "line", "name": "token budget", "data": data, "symbol": "none",
                "xAxisIndex": 0, "yAxisIndex": 0, "silent": True,
                "lineStyle": {"type": "dashed", "color": BUDGET_COLOR, "width": 1.5}}

    def _on_click(self, e: EChartPointClickEventArguments) -> None:
        value = e.value if isinstance(e.value, list) else []
        if len(value) > 6 and isinstance(value[6], str) and value[4] != MERGED:
            self.selection.select_request(value[6])

