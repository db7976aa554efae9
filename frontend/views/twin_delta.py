"""One prompt served twice, token by token: how far apart its log-probabilities came out.

The nondeterminism lesson (scenarios/nondeterminism.yaml) serves one prompt alone, in a crowd and from the
prefix cache. Greedy decoding picks a token from nearly the same numbers each time, so the words mostly
agree; the log-probabilities differ in their last bits or more, because the sums inside each matmul ran in
another order (docs/engine.md#batch-invariant-mode). This strip, under the sampling view's tokens, compares
the selected request with the first request of the same prompt and settings: |Δ log-probability| per
token on a log scale (identical bits drawn at the floor) and the first token that came out different,
where the two outputs part and comparing them ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nicegui import ui

from kvscope.backend.events.history import RunHistory
from kvscope.backend.events.state import RunState
from kvscope.frontend.palette import TOKEN_MARK_COLORS
from kvscope.frontend.views.charts import make_chart
from kvscope.frontend.views.live_text import LiveText

FLOOR = 1e-9  # where identical bits are drawn: a log axis has no 0 (float32 log-probabilities differ by ≥ 1e-8)
SAME_COLOR, DIFF_COLOR = "#9aa5b1", "#4e79a7"


@dataclass(frozen=True)
class TwinDeltas:
    twin: str  # the first request with the same prompt and sampling
    deltas: list[float]  # |Δ log-probability| per output position, up to the first flip (included)
    texts: list[str]  # this request's token texts at those positions
    flip: int | None  # the first position whose token differs; None: none did
    twin_text: str | None  # the twin's token at the flip


def twin_of(state: RunState, rid: str) -> str | None:
    """The first request, in arrival order, with rid's prompt and sampling (not rid itself)."""
    me = state.requests.get(rid)
    if me is None or me.joined:
        return None
    return next((r.id for r in state.requests.values() if r.id != rid and not r.joined
                 and (r.prompt_text, r.prompt_len, r.sampling) == (me.prompt_text, me.prompt_len, me.sampling)), None)


def twin_deltas(state: RunState, history: RunHistory, rid: str) -> TwinDeltas | None:
    """rid against the first request of its prompt, token by token; None when it has no such twin."""
    twin = twin_of(state, rid)
    if twin is None or not state.requests[twin].seq_ids or not state.requests[rid].seq_ids:
        return None
    mine = history.seq_output(state, state.requests[rid].seq_ids[0])
    theirs = history.seq_output(state, state.requests[twin].seq_ids[0])
    deltas, texts, flip = [], [], None
    for i, (a, b) in enumerate(zip(mine, theirs)):
        deltas.append(abs(a.event["logprob"] - b.event["logprob"]))
        texts.append(a.event["text"])
        if a.event["token_id"] != b.event["token_id"]:
            flip = i
            break
    return TwinDeltas(twin, deltas, texts, flip, theirs[flip].event["text"] if flip is not None else None)


def caption(rid: str, d: TwinDeltas) -> str:
    """The comparison in words: the largest difference, how many tokens kept every bit, the first flip."""
    n = len(d.deltas)
    if not n:
        return f"{rid}: the same prompt as {d.twin}; no tokens of both yet."
    same = sum(x == 0 for x in d.deltas)
    if same == n:
        return f"{rid} against {d.twin} (the same prompt): the same token and the same bits at all {n} tokens."
    worst = max(range(n), key=d.deltas.__getitem__)
    text = (f"{rid} against {d.twin} (the same prompt): |Δ log-prob| up to {d.deltas[worst]:.2g} (token {worst + 1}, "
            f"{d.texts[worst]!r})")
    if n > 1:
        text += f"; the same bits at {same} of {n} tokens"
    if d.flip is not None:
        text += (f"; token {d.flip + 1} came out different: {d.texts[d.flip]!r} here, {d.twin_text!r} in {d.twin} "
                 "(the answers part there)")
    return text + "."


def chart_option(d: TwinDeltas) -> dict[str, Any]:
    """A dot of |Δ| per token on a log axis (points: ECharts grows a log axis's bars down from its top); identical
    bits grey at the floor, the flip in the chosen token's colour."""
    def dot(i: int, x: float) -> dict:
        color = TOKEN_MARK_COLORS["chosen"] if i == d.flip else SAME_COLOR if x == 0 else DIFF_COLOR
        return {"value": max(x, FLOOR), "itemStyle": {"color": color}}
    return {"xAxis": {"data": [f"{i + 1} {t!r}" for i, t in enumerate(d.texts)]},
            "series": [{"type": "scatter", "name": "|Δ log-prob|", "symbolSize": 11,
                        "data": [dot(i, x) for i, x in enumerate(d.deltas)]}]}


class TwinStrip:
    """The caption and the chart, hidden for a request whose prompt was served once."""

    def __init__(self) -> None:
        with ui.column().classes("w-full gap-0") as self.box:
            self.caption = LiveText().classes("kv-small w-full").mark("twin-caption").props("data-kv=twin-caption")
            self.chart = make_chart({
                "grid": {"left": 72, "right": 12, "top": 8, "bottom": 44},
                "tooltip": {"trigger": "axis"},
                "xAxis": {"type": "category", "data": [], "axisLabel": {"interval": 0, "rotate": 30, "fontSize": 11}},
                # a label every third decade (the floor "same", 1e-6, 1e-3, 1, ...) in 140 px; no top: at a flip
                # the two log-probabilities may lie several nats apart
                "yAxis": {"type": "log", "min": FLOOR, "interval": 3, "name": "|Δ log-prob|",
                          "nameLocation": "middle", "nameGap": 44,
                          "axisLabel": {":formatter": "(v) => v <= 1e-9 ? 'same' : v === 1 ? '1' : v.toExponential(0)"}},
                "series": []}, "140px", "twin-chart")
        self.box.set_visibility(False)

    def option(self, state: RunState, history: RunHistory, rid: str | None) -> dict[str, Any] | None:
        """What to draw for rid (the caption set, the box shown or hidden); None when nothing is to be drawn."""
        d = twin_deltas(state, history, rid) if rid else None
        self.box.set_visibility(d is not None)
        if d is None:
            return None
        self.caption.set(caption(rid, d))
        return chart_option(d)
