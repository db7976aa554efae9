"""Sampling distribution of one token: raw, after temperature, top-k, top-p, min-p; with what-if knobs."""

from __future__ import annotations

import html

from nicegui import ui
from nicegui.events import GenericEventArguments

from frontend.client import LogEntry, RunFeed
from frontend.sampling_math import STAGE_LABELS, STAGES, Knobs, Stages, compute_stages, knobs_of
from frontend.selection import Selection
from frontend.palette import TOKEN_MARK_COLORS
from frontend.views.base import FeedView, legend, view_card
from frontend.views.charts import make_chart, probability_bars
from frontend.views.live_text import LiveText

EXPLANATION = """
The model gives a probability to every token of the vocabulary (**raw**, the softmax at T = 1).
The sampler then reshapes it, in this order:

1. **temperature** T: divides the logits by T; T < 1 sharpens, T > 1 flattens, T = 0 is greedy.
2. **top-k**: keeps the k most likely tokens.
3. **top-p** (nucleus): keeps the smallest set of most likely tokens holding p of the mass.
4. **min-p**: keeps tokens at least min-p times as likely as the best one.

The survivors are renormalised: that **final** distribution is what the token is drawn from. The
end-of-sequence token (EOS) survives every cut (so the model can always stop) unless the request
sets `truncate_eos`. Move the sliders to see what other settings would have done (*what-if*); the
black ticks are the engine's own final probabilities for the settings the request really used.
Only the top tokens are in the event: the rest of the vocabulary is the last bar ("other").
"""

STAGE_COLORS = {"raw": "#bab0ac", "temperature": "#4e79a7", "top_k": "#76b7b2", "top_p": "#b07aa1",
                "min_p": "#f28e2b"}
# What colours the token axis (the bars are named by the chart's own legend).
LEGEND = [(TOKEN_MARK_COLORS["chosen"], "▶ the chosen token"), (TOKEN_MARK_COLORS["eos"], "EOS: end of sequence")]
TOKEN_STRIP = 48  # recent tokens shown as clickable text
CLICK_JS = "(e) => { const i = e.target.dataset && e.target.dataset.i; if (i !== undefined) emit(Number(i)); }"


def token_label(text: str) -> str:
    if text == "":
        return "∅"
    return text.replace("\n", "⏎").replace(" ", "␣")[:14]


def axis_labels(stages: Stages, chosen: int, eos: set[int]) -> list[dict]:
    labels = []
    for token_id, text in zip(stages.token_ids, stages.texts):
        style: dict = {}
        if token_id == chosen:
            style = {"color": TOKEN_MARK_COLORS["chosen"], "fontWeight": "bold"}
        elif token_id in eos:
            style = {"color": TOKEN_MARK_COLORS["eos"], "fontStyle": "italic"}
        name = "EOS" if token_id in eos else token_label(text)
        labels.append({"value": ("▶ " if token_id == chosen else "") + name, "textStyle": style})
    labels.append({"value": f"other (~{stages.tail_count})", "textStyle": {"color": "#888"}})
    return labels


class SamplingView(FeedView):
    name = "sampling"

    def __init__(self, feed: RunFeed, selection: Selection, height: str = "300px") -> None:
        self.selection = selection
        self.what_if: Knobs | None = None
        self.shown: tuple | None = None
        with view_card("Sampling: from logits to the chosen token", EXPLANATION, "w-full"):
            self.caption = LiveText().classes("kv-caption").mark("sampling-caption")
            self.strip = LiveText(html=True).classes("kv-token-strip w-full").mark("token-strip")
            self.strip.on("click", self._on_token_click, js_handler=CLICK_JS)
            legend(LEGEND)
            self.chart = make_chart(probability_bars(), height, "sampling")
            self._sliders()
        selection.on_change(self.invalidate)
        super().__init__(feed)

    def _sliders(self) -> None:
        self.knob_inputs: dict[str, ui.slider] = {}
        with ui.row().classes("w-full items-center gap-4 no-wrap"):
            for key, label, lo, hi, step in (("temperature", "T", 0, 2, 0.05), ("top_k", "top-k", 0, 50, 1),
                                             ("top_p", "top-p", 0.05, 1, 0.01), ("min_p", "min-p", 0, 1, 0.01)):
                with ui.column().classes("gap-0 grow"):
                    ui.label(label).classes("kv-small")
                    self.knob_inputs[key] = ui.slider(min=lo, max=hi, step=step, value=lo) \
                        .props("label dense").on("update:model-value", self._on_knob, throttle=0.1) \
                        .mark(f"knob-{key}")
            ui.button("reset", on_click=self.reset_knobs).props("flat dense size=sm").mark("knob-reset") \
                .tooltip("back to the settings this request was sampled with")

    # -- selection ---------------------------------------------------------------------------------

    def _tokens(self) -> tuple[str | None, list[dict]]:
        rid = self.selection.current(self.feed.state)
        return rid, list(self.feed.history.tokens.get(rid, ())) if rid else []

    def _selected_token(self) -> tuple[str | None, int, dict | None]:
        rid, tokens = self._tokens()
        if not tokens:
            return rid, -1, None
        index = self.selection.token_index
        if index is None or not 0 <= index < len(tokens):
            index = len(tokens) - 1
        return rid, index, tokens[index]

    def _on_token_click(self, e: GenericEventArguments) -> None:
        index = e.args[0] if isinstance(e.args, list) else e.args
        if isinstance(index, (int, float)):
            self.selection.select_token(int(index))

    def _on_knob(self) -> None:
        self.what_if = Knobs(temperature=float(self.knob_inputs["temperature"].value),
                             top_k=int(self.knob_inputs["top_k"].value), top_p=float(self.knob_inputs["top_p"].value),
                             min_p=float(self.knob_inputs["min_p"].value),
                             truncate_eos=self._truncate_eos())
        self.invalidate()

    def set_knobs(self, knobs: Knobs) -> None:
        """What-if: recompute the stages with these settings (also what the sliders call)."""
        self.what_if = knobs
        for key in ("temperature", "top_k", "top_p", "min_p"):
            self.knob_inputs[key].value = getattr(knobs, key)
        self.what_if = knobs  # the slider handlers may have rebuilt it from a half-updated set
        self.invalidate()

    def reset_knobs(self) -> None:
        self.what_if = None
        self.shown = None
        self.invalidate()

    def _truncate_eos(self) -> bool:
        rid = self.selection.current(self.feed.state)
        view = self.feed.state.requests.get(rid) if rid and self.feed.state else None
        return bool(view and view.sampling.get("truncate_eos"))

    # -- drawing -----------------------------------------------------------------------------------

    def full(self) -> bool:
        rid, index, token = self._selected_token()
        key = (rid, index, token["seq"] if token else None, self.what_if)
        if key == self.shown:
            return False
        self.shown = key
        self._strip(rid, index)
        if token is None or not token.get("dist"):
            self.caption.set(f"{rid or 'No request'}: no token with a distribution yet "
                                  "(events level `full` records them).")
            self.push(self.chart, {"xAxis": {"data": []}, "series": []}, replace_series=True)
            return True
        self._draw(token)
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        rid = self.selection.current(self.feed.state)
        if rid != (self.shown[0] if self.shown else None):
            return self.full()  # following the running requests moved on to another one
        if self.selection.token_index is not None:
            return False  # a fixed token: new tokens do not change the picture
        if any(e.event["type"] == "token" and e.event["request_id"] == rid for e in entries):
            return self.full()
        return False

    def _draw(self, token: dict) -> None:
        dist = token["dist"]
        view = self.feed.state.requests.get(token["request_id"])
        actual = knobs_of(dist, view.sampling if view else None)
        knobs = self.what_if or actual
        if self.what_if is None:
            for key in ("temperature", "top_k", "top_p", "min_p"):
                self.knob_inputs[key].set_value(getattr(actual, key))
            self.what_if = None  # setting the sliders is not a what-if
        eos = set(self.feed.state.model.get("eos_token_ids") or [])
        stages = compute_stages(dist["top"], knobs, eos, self.feed.state.model.get("vocab_size", 0))
        self.caption.set(self._caption(token, knobs, actual))
        series = [{"id": s, "name": STAGE_LABELS[s], "type": "bar", "color": STAGE_COLORS[s], "barGap": "5%",
                   "data": [round(p, 4) for p in stages.probs[s]] + [round(stages.tail[s], 4)]} for s in STAGES]
        if knobs == actual:
            final = {t[0]: t[3] for t in dist["top"]}
            series.append({"id": "engine", "name": "engine's final", "type": "scatter", "symbol": "rect",
                           "symbolSize": [14, 3], "color": "#111",
                           "data": [round(final.get(t, 0.0), 4) for t in stages.token_ids] + [None]})
        self.push(self.chart, {"xAxis": {"data": axis_labels(stages, token["token_id"], eos)}, "series": series},
             replace_series=True)

    def _caption(self, token: dict, knobs: Knobs, actual: Knobs) -> str:
        what_if = "what-if " if knobs != actual else ""
        settings = "greedy" if knobs.greedy else (f"T={knobs.temperature:g} top-k={knobs.top_k} "
                                                  f"top-p={knobs.top_p:g} min-p={knobs.min_p:g}")
        return (f"{token['request_id']} · position {token['position']} · chose {token_label(token['text'])!r} "
                f"(raw p = {2.718281828 ** token['logprob']:.3f}) · {what_if}{settings}")

    def _strip(self, rid: str | None, index: int) -> None:
        _, tokens = self._tokens()
        first = max(0, len(tokens) - TOKEN_STRIP)
        spans = []
        for i in range(first, len(tokens)):
            cls = "kv-tok kv-tok-selected" if i == index else "kv-tok"
            spans.append(f'<span class="{cls}" data-i="{i}">{html.escape(token_label(tokens[i]["text"]))}</span>')
        self.strip.set("".join(spans) or '<span class="kv-muted">no tokens yet</span>')
