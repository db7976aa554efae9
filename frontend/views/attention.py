"""Attention mask of the selected request (or the whole batch) in one iteration."""

from __future__ import annotations

from typing import Any

from nicegui import ui

from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.frontend.palette import MASK_COLORS
from kvscope.frontend.selection import Selection
from kvscope.frontend.views.base import FeedView, Js, legend, view_card
from kvscope.frontend.views.charts import make_chart
from kvscope.frontend.views.live_text import LiveText

EXPLANATION = """
Rows are **queries** (the tokens computed in this iteration), columns are **keys** (every token
they may look at). A query at position *q* attends to keys 0..*q* and never to the future: the
**causal** mask.

- **prefill**: the whole prompt at once: a full triangle.
- **chunked prefill**: a later chunk of a long prompt: its queries read the earlier chunks from the
  **KV cache** (blue columns) plus a triangle over the chunk itself (orange).
- **prefix cache hit**: the same picture: the shared prefix is read, not recomputed.
- **decode**: a single row: one new token reads the entire cache.

A request with several sequences (n > 1, beam search) shows the selected sequence (the sequence
picker of the sampling panel): its own keys, the prompt it shares with its siblings included.

*Whole batch* stacks every sequence of the iteration: a **variable-length block diagonal**. The
kernels never compute the white area; this is why batching requests of different lengths costs no
padding.
"""

LEGEND = [(MASK_COLORS["cached"], "key from the KV cache"), (MASK_COLORS["computed"], "key computed now (causal)"),
          (MASK_COLORS["masked"], "masked: future"), ("#ffffff", "other sequence: never computed")]

ROW_PX = 22  # tallest a query row is drawn
MAX_ROWS = 600  # rows drawn; beyond this every k-th query row is drawn (the picture is the same)
MASK_SERIES = {"id": "mask", "type": "custom", "renderItem": Js("kvscope.maskRow"), "encode": {"x": [1, 4], "y": 0},
               "clip": True, "tooltip": {":formatter": "kvscope.maskTip"}}


def mask_items(events: list[dict], rows_of: dict[str, int]) -> tuple[list[list[Any]], int, int]:
    """[row, key offset, cached, q, key_len, colour, request_id] per drawn query row; (items, rows, keys).

    Only the drawn rows are built (every stride-th past MAX_ROWS): a step's queries may number a million."""
    total = sum(e["query_positions"][1] - e["query_positions"][0] for e in events)
    stride = max(1, -(-total // MAX_ROWS))
    items, row, offset = [], 0, 0
    for e in events:
        start, end = e["query_positions"]
        for q in range(start + (-row) % stride, end, stride):  # the queries whose row is a multiple of stride
            items.append([row + q - start, offset, start, q, e["key_len"], rows_of.get(e["request_id"], 0),
                          e["request_id"]])
        row += end - start
        offset += e["key_len"]
    return items, row, offset


def describe(events: list[dict], step: int, batch: bool, several: bool = False) -> str:
    if not events:
        return ("No attention mask for this selection yet: masks are drawn from the iterations seen since this "
                "page connected (and only with engine.events = full).")
    if batch:
        queries = sum(e["query_positions"][1] - e["query_positions"][0] for e in events)
        keys = sum(e["key_len"] for e in events)
        return f"iteration {step} · {len(events)} sequences · {queries} queries · {keys} keys"
    e = events[0]
    start, end = e["query_positions"]
    cached = f" ({start} from the cache)" if start else ""
    who = f"{e['request_id']} · seq {e['seq_id']}" if several else e["request_id"]
    return (f"{who} · iteration {step} · {e['kind']} · queries {start}..{end - 1} · "
            f"{e['key_len']} keys{cached}")


class AttentionView(FeedView):
    name = "attention"

    def __init__(self, feed: RunFeed, selection: Selection, height: str = "300px") -> None:
        self.selection = selection
        self.batch = False
        self.shown: tuple | None = None
        self.plot_height = int(height.removesuffix("px")) - 50
        with view_card("Attention mask", EXPLANATION, "w-full"):
            with ui.row().classes("items-center gap-2 w-full"):
                ui.toggle({False: "this request", True: "whole batch"}, value=False,
                          on_change=lambda e: self.set_batch(bool(e.value))).props("dense size=sm").mark("mask-mode")
                ui.button(icon="chevron_left", on_click=lambda: self.move(-1)).props("flat dense round size=sm") \
                    .mark("mask-prev").tooltip("previous iteration of this request")
                ui.button(icon="chevron_right", on_click=lambda: self.move(1)).props("flat dense round size=sm") \
                    .mark("mask-next").tooltip("next iteration of this request")
                ui.button("latest", on_click=lambda: self.selection.select_mask_step(None)) \
                    .props("flat dense size=sm").mark("mask-latest")
            self.caption = LiveText().classes("kv-caption").mark("mask-caption")
            legend(LEGEND)
            self.chart = make_chart(self._options(), height, "attention")
        selection.on_change(self.invalidate)
        super().__init__(feed)

    def _options(self) -> dict:
        return {
            "grid": {"left": 56, "right": 16, "top": 10, "bottom": 40},
            "tooltip": {"trigger": "item"},
            "xAxis": {"type": "value", "name": "key position", "nameLocation": "middle", "nameGap": 22, "min": 0},
            "yAxis": {"type": "value", "name": "query", "inverse": True, "minInterval": 1,
                      "axisLabel": {":formatter": "(v) => Number.isInteger(v) ? String(v) : ''"}},
            "series": [],
        }

    def set_batch(self, batch: bool) -> None:
        self.batch = batch
        self.invalidate()

    def move(self, direction: int) -> None:
        rid = self.selection.current(self.feed.state)
        steps = self.feed.history.mask_steps(rid, self.selection.sequence(self.feed.state)) if rid else []
        if not steps:
            return
        current = self.selection.mask_step if self.selection.mask_step in steps else steps[-1]
        index = max(0, min(len(steps) - 1, steps.index(current) + direction))
        self.selection.select_mask_step(steps[index])

    def _selected(self) -> tuple[int | None, list[dict]]:
        """The iteration shown and its masks: the whole batch, or the selected sequence's own."""
        history, state = self.feed.history, self.feed.state
        rid, seq = self.selection.current(state), self.selection.sequence(state)
        if rid is None:
            return None, []
        step = self.selection.mask_step
        if step is None or step not in history.masks:
            steps = history.mask_steps(rid, seq) or history.mask_steps(rid)
            step = steps[-1] if steps else None
        if step is None:
            return None, []
        events = history.masks[step]
        if self.batch:
            return step, events
        mine = [e for e in events if e["request_id"] == rid]
        # its sequences side by side would read as one long context: one sequence, the selected one
        # if it ran in that iteration (it may have been forked later, or pruned before)
        return step, [next((e for e in mine if e["seq_id"] == seq), mine[0])] if mine else []

    def full(self) -> bool:
        step, events = self._selected()
        key = (step, self.batch, tuple((e["seq_id"], e["key_len"]) for e in events))
        if key == self.shown:
            return False
        self.shown = key
        rid = self.selection.current(self.feed.state)
        view = self.feed.state.requests.get(rid) if rid else None
        self.caption.set(describe(events, step or 0, self.batch, view is not None and len(view.seq_ids) > 1))
        items, rows, keys = mask_items(events, self.feed.history.rows)
        if self.batch or not events:
            y = {"min": -0.5, "max": max(rows, 1) - 0.5, "name": "query (all sequences)",
                 "axisLabel": {"show": not self.batch}}
        else:
            start, end = events[0]["query_positions"]
            items = [[it[3], *it[1:]] for it in items]  # rows labelled by absolute query position
            y = {"min": start - 0.5, "max": end - 0.5, "name": "query position", "axisLabel": {"show": True}}
        grid = {"height": min(self.plot_height, max(len(items), 1) * ROW_PX)}  # a decode row stays a row
        self.push(self.chart, {"xAxis": {"max": max(keys, 1)}, "yAxis": y, "grid": grid,
                          "series": [{**MASK_SERIES, "data": items}]}, replace_series=True)
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        if not any(e.event["type"] == "attention_mask" for e in entries):
            return False
        return self.full()
