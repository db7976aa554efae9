"""Sampling distribution of one token: raw, after temperature, top-k, top-p, min-p; with what-if knobs."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import numpy as np
from nicegui import ui
from nicegui.events import GenericEventArguments

from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.frontend.grammar_position import position_text
from kvscope.frontend.sampling_math import (STAGE_LABELS, STAGES, Knobs, Mask, Stages, compute_stages, decode_row,
                                            knobs_of, recorded_row)
from kvscope.frontend.selection import Selection
from kvscope.frontend.palette import TOKEN_MARK_COLORS
from kvscope.frontend.views.base import FeedView, legend, legend_html, view_card
from kvscope.frontend.views.charts import make_chart, probability_bars
from kvscope.frontend.views.live_text import LiveText
from kvscope.frontend.views.sequences import SeqLine, is_beam, seq_line, seq_lines, token_label, tokens_html
from kvscope.frontend.views.twin_delta import TwinStrip

EXPLANATION = """
The model gives a probability to every token of the vocabulary (**raw**, the softmax at T = 1).
The sampler then reshapes it, in this order:

1. **temperature** T: divides the logits by T; T < 1 sharpens, T > 1 flattens, T = 0 is greedy.
2. **top-k**: keeps the k most likely tokens (and any tied with the k-th).
3. **top-p** (nucleus): keeps the smallest set of the top-k survivors holding p of their mass.
4. **min-p**: keeps tokens at least min-p times as likely as the best one.

The survivors are renormalised: that **final** distribution is what the token is drawn from. The
end-of-sequence token (EOS) survives every cut (so the model can always stop) unless the request
sets `truncate_eos`. Move the sliders to see what other settings would have done (*what-if*); the
black ticks are the engine's own final probabilities for the settings the request really used.
The chart names each filter with the share of the mass it removed, and the line under it says it in
words. The event records only the top tokens; the rest of the vocabulary is the last bar ("other").
When the token's whole distribution is at hand every stage is computed over all of it (*exact*): the
run records it for each sequence's first token and each token a grammar forced (so a saved run or a
replay has it too), and a live server keeps it for recent tokens. Otherwise the later stages model
how the rest of the vocabulary shares the mass not shown, and the view says *approximate* (the count
of the other tokens and the mass they hold are facts; what the filters leave of it is modelled, "~").
The **log** scale shows the small probabilities a flat distribution spreads over (on by default
when no token reaches a quarter).

A request with several sequences (n > 1, beam search) shows one row of text per sequence; pick
one (or click a token in its row) to see its tokens. Beam search samples nothing: each step it
keeps the (beam, token) pairs with the highest **total log-probability**, shown per row with the
beam's **score** (total / length ^ length_penalty, how finished beams are ranked); a beam not kept
is **pruned** (struck through). For a beam token the chart compares the candidates kept that step.

A request with **structured outputs** (a JSON schema, a regex, a choice, a grammar) is sampled under
the grammar's mask: before every other stage, each token the grammar does not allow next gets
probability 0 and the rest are renormalised. The chart then starts one stage earlier: **model** is
the model's own distribution, **after the grammar's mask** what is left of it (the legend names the
share it removed; a masked token is marked ✕ and greyed), and every later stage works on that. The
line under the chart says how many tokens the grammar allowed and where the output stands in it
(for JSON, the path of the value being written).

When the run served the same prompt with the same settings before (the nondeterminism lesson), a
strip under the tokens compares this request with that first one, token by token: |Δ log-probability|
on a log scale (grey at the floor: the same bits), and the first token that came out different. In
the default mode the numbers move with the batch around a request and with what the cache held; with
`engine.batch_invariant` they cannot (docs/engine.md#batch-invariant-mode).
"""

# grey: the model's own distribution (raw, or "model" before a grammar's mask)
STAGE_COLORS = {"raw": "#bab0ac", "model": "#bab0ac", "masked": "#9c755f", "temperature": "#4e79a7",
                "top_k": "#76b7b2", "top_p": "#b07aa1", "min_p": "#f28e2b"}
BEAM_COLORS = {"picked": "#d62728", "other": "#9aa5b1"}
CLICK_JS = ("(e) => { const d = e.target.dataset; "
            "if (d && d.i !== undefined) emit([Number(d.i), d.s === undefined ? null : Number(d.s)]); }")
# What colours the token axis (the bars are named by the chart's own legend).
LEGEND = [(TOKEN_MARK_COLORS["chosen"], "▶ the chosen token"), (TOKEN_MARK_COLORS["eos"], "EOS: end of sequence")]
MASK_LEGEND = [(TOKEN_MARK_COLORS["masked"], "✕ masked by the grammar")]  # shown beside LEGEND under a grammar
ROWS_KEPT = 16  # whole distributions cached by the view (a SmolLM2 row is 49,152 floats)
LOG_MIN = 1e-4  # the log axis's floor: a token below a hundredth of a percent is not drawn
AUTO_LOG_BELOW = 0.25  # the log scale is the default when no shown token reaches this raw probability
FILTER_NAMES = {"top_k": "top-k", "top_p": "top-p", "min_p": "min-p"}
RowKey = tuple[str, str, int, int]  # (run_id, request_id, seq_id, position)


def axis_labels(stages: Stages, chosen: int, eos: set[int]) -> list[dict]:
    labels = []
    for token_id, text in zip(stages.token_ids, stages.texts):
        style: dict = {}
        if token_id == chosen:
            style = {"color": TOKEN_MARK_COLORS["chosen"], "fontWeight": "bold"}
        elif token_id in stages.masked:
            style = {"color": TOKEN_MARK_COLORS["masked"]}
        elif token_id in eos:
            style = {"color": TOKEN_MARK_COLORS["eos"], "fontStyle": "italic"}
        name = "EOS" if token_id in eos else token_label(text)
        mark = "▶ " if token_id == chosen else "✕ " if token_id in stages.masked else ""
        labels.append({"value": mark + name, "textStyle": style})
    labels.append({"value": f"other ({stages.tail_count:,})", "textStyle": {"color": "#888"}})
    return labels


def share(x: float) -> str:
    """A share of the mass in percent: never "100%" for less than all of it (a mask removes 99.9%)."""
    return f"{min(x, 0.999):.1%}" if 0.995 <= x < 1.0 else f"{x:.0%}"


def cuts_text(stages: Stages, knobs: Knobs) -> str:
    """In words, what the chart's stages did: each filter's removed share and where the rest of the vocabulary went."""
    active = {"top_k": knobs.top_k > 0, "top_p": knobs.top_p < 1.0, "min_p": knobs.min_p > 0.0}
    parts = [] if knobs.greedy else [f"{FILTER_NAMES[s]} removed {share(stages.removed[s])}" for s in STAGES[2:]
                                     if active[s]] or ["no cut (top-k, top-p and min-p are off)"]
    if stages.mask is not None:
        allowed = stages.mask.num_allowed
        parts.insert(0, f"the grammar allowed {allowed:,} token{'' if allowed == 1 else 's'} and removed "
                        f"{share(stages.mask.mass)} of the model's mass")
    first = stages.names[0]  # raw, or the model's own before a grammar's mask
    # the first stage's tail is a fact (1 - the shown tokens' sum); the final one is modelled unless exact
    final = f"{stages.tail['min_p']:.1%}" if stages.exact else f"~{stages.tail['min_p']:.1%} (modelled)"
    tail = f"other: {stages.tail_count:,} tokens holding {stages.tail[first]:.1%} {first} → {final} final"
    return " · ".join([*parts, tail])


def exactness_text(stages: Stages, recorded: int, fetching: bool, penalised: bool) -> str:
    """Whether the stages are the engine's to the last token, and if not, why not."""
    if penalised:  # the row is the raw one; the engine sampled from the penalised logits
        return "approximate: repetition, presence and frequency penalties are not recomputed"
    if stages.exact:
        return f"exact: every stage over the whole distribution ({len(stages.token_ids) + stages.tail_count:,} tokens)"
    if fetching:
        return "fetching the whole distribution…"
    return (f"approximate: only the top {recorded} tokens were recorded; the later stages model how the other "
            f"{stages.tail_count:,} tokens share their {stages.tail[stages.names[0]]:.1%} (none more likely than "
            "the last shown)")


def chosen_text(stages: Stages, token_id: int) -> str:
    """The chosen token's probability as its bars show it: the first stage's (under a grammar the model's own,
    then after the mask; the event's logprob is the latter, which the model's bar is not)."""
    i = stages.token_ids.index(token_id)  # the event's top always holds the chosen token
    if stages.mask is None:
        return f"raw p = {prob_text(stages.probs['raw'][i])}"
    return f"model p = {prob_text(stages.probs['model'][i])}, after the mask {prob_text(stages.probs['masked'][i])}"


def prob_text(p: float) -> str:
    """Three decimals, or two significant digits below 0.01 (a masked favourite leaves 0.00062, not 0.001)."""
    return f"{p:.3f}" if p >= 0.01 or p == 0.0 else f"{p:.2g}"


def penalised(sampling: dict) -> bool:
    return any(sampling.get(k, d) != d for k, d in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                                     ("frequency_penalty", 0.0)))


def stage_name(stages: Stages, stage: str) -> str:
    """The legend's name of a stage: a filter says what share of the mass it was given it removed."""
    removed = stages.removed.get(stage)
    return STAGE_LABELS[stage] + (f" (−{share(removed)})" if removed is not None and removed >= 0.005 else "")


def bar_values(values: list[float], log: bool) -> list[float | None]:
    """Rounded for the wire; on a log axis a zero is no bar at all (log 0 has no place on it)."""
    return [None if log and v < LOG_MIN else round(v, 6 if log else 4) for v in values]


class SamplingView(FeedView):
    name = "sampling"

    def __init__(self, feed: RunFeed, selection: Selection, height: str = "300px") -> None:
        self.selection = selection
        self.what_if: Knobs | None = None
        self.shown: tuple | None = None
        self.rows: OrderedDict[RowKey, np.ndarray | None] = OrderedDict()  # None: the server keeps none
        self.fetching: set[RowKey] = set()
        self.log_scale: bool | None = None  # None: automatic (log for a flat distribution)
        self.drawn_log: bool | None = None
        self.stages: Stages | None = None  # what the chart draws now (the tests read it)
        with view_card("Sampling: from logits to the chosen token", EXPLANATION, "w-full"):
            with ui.row().classes("w-full items-center no-wrap gap-2"):
                self.caption = LiveText().classes("kv-caption grow").mark("sampling-caption")
                self.seq_picker = ui.select({}, label="sequence", on_change=self._on_seq_pick) \
                    .classes("w-28").props("dense").mark("seq-picker")
            self.seq_picker.set_visibility(False)
            self.strip = LiveText(html=True).classes("kv-token-strip w-full").mark("token-strip") \
                .props("data-kv=token-strip")
            self.strip.on("click", self._on_token_click, js_handler=CLICK_JS)
            self.twin = TwinStrip()
            self.legend = legend(LEGEND)
            options = probability_bars()
            options["grid"]["left"] = 64  # room for the log axis's 0.0001 and the axis name beside it
            self.chart = make_chart(options, height, "sampling")
            with ui.row().classes("w-full items-center no-wrap gap-2"):
                # data-kv: for the browser test
                self.cuts = LiveText().classes("kv-small grow").mark("sampling-cuts").props("data-kv=sampling-cuts")
                self.exactness = LiveText().classes("kv-small").mark("sampling-exactness") \
                    .props("data-kv=sampling-exactness")
                self.scale = ui.toggle({False: "linear", True: "log"}, value=None, on_change=self._on_scale) \
                    .props("dense no-caps size=sm data-kv=sampling-scale").mark("sampling-scale")
            # the grammar and where the output stands in it (structured outputs); empty otherwise
            self.grammar = LiveText().classes("kv-small w-full").mark("sampling-grammar") \
                .props("data-kv=sampling-grammar")
            self._sliders()
        selection.on_change(self.invalidate)
        super().__init__(feed)

    def _sliders(self) -> None:
        self.knob_inputs: dict[str, ui.slider] = {}
        with ui.row().classes("w-full items-center gap-4 no-wrap"):
            for key, label, lo, hi, step in (("temperature", "T", 0, 2, 0.05), ("top_k", "top-k", 0, 50, 1),
                                             ("top_p", "top-p", 0.05, 1, 0.01), ("min_p", "min-p", 0, 1, 0.01)):
                with ui.column().classes("gap-0 grow"):
                    caption = ui.label(label).classes("kv-small").mark(f"knob-{key}-value")
                    self.knob_inputs[key] = ui.slider(min=lo, max=hi, step=step, value=lo) \
                        .props("label dense").on("update:model-value", self._on_knob, throttle=0.1) \
                        .mark(f"knob-{key}")
                    # the value always in sight (the slider's own label shows only while dragged)
                    caption.bind_text_from(self.knob_inputs[key], "value", lambda v, name=label: f"{name} = {v:g}")
            ui.button("reset", on_click=self.reset_knobs).props("flat dense size=sm").mark("knob-reset") \
                .tooltip("back to the settings this request was sampled with")

    # -- selection ---------------------------------------------------------------------------------

    def _tokens(self) -> tuple[str | None, int | None, list]:
        """The current request, its selected sequence and that sequence's output on record."""
        state = self.feed.state
        rid, seq = self.selection.current(state), self.selection.sequence(state)
        return rid, seq, self.feed.history.seq_output(state, seq) if seq is not None else []

    def _selected_token(self) -> tuple[str | None, int | None, int, dict | None]:
        rid, seq, tokens = self._tokens()
        if not tokens:
            return rid, seq, -1, None
        index = self.selection.token_index
        if index is None or not 0 <= index < len(tokens):
            index = len(tokens) - 1
        return rid, seq, index, tokens[index].event

    def _on_token_click(self, e: GenericEventArguments) -> None:
        index, seq = (e.args + [None])[:2] if isinstance(e.args, list) else (e.args, None)
        if isinstance(index, (int, float)):
            self.selection.select_token(int(index), int(seq) if isinstance(seq, (int, float)) else None)

    def _on_seq_pick(self) -> None:
        value = self.seq_picker.value
        if value is not None and value != self.selection.sequence(self.feed.state):
            self.selection.select_sequence(int(value))

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

    def _on_scale(self) -> None:
        if self.scale.value is not None and self.scale.value != self.drawn_log:  # the user's pick, not the view's
            self.log_scale = bool(self.scale.value)
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
        rid, seq, index, token = self._selected_token()
        key = (rid, seq, index, token["seq"] if token else None, self.what_if, self._rows_key(rid), self.log_scale,
               self._row_key(token) in self.rows if token else None)
        if key == self.shown:
            return False
        self.shown = key
        lines = seq_lines(self.feed.state, self.feed.history, rid) if rid else []
        self._strip(lines, seq, index)
        if (twin := self.twin.option(self.feed.state, self.feed.history, rid)) is not None:
            self.push(self.twin.chart, twin, replace_series=True)
        self._picker(lines, seq)
        self._grammar(rid, index)
        if token is not None and token.get("dist"):
            self._draw(token)
        elif token is not None and is_beam(self.feed.state, rid):
            self._draw_beams(token)
        else:
            self.caption.set(f"{rid or 'No request'}: no token with a distribution yet "
                             "(events level `full` records them).")
            self.push(self.chart, {"xAxis": {"data": []}, "series": []}, replace_series=True)
            self.cuts.set("")
            self.exactness.set("")
        return True

    def _grammar(self, rid: str | None, index: int) -> None:
        """Where the selected token stands in its request's grammar: the text before it, read against it."""
        view = self.feed.state.requests.get(rid) if rid else None
        before = "".join(t.event["text"] for t in self._tokens()[2][:max(index, 0)])
        self.grammar.set(position_text(view.sampling if view else None, before))

    def _rows_key(self, rid: str | None) -> tuple:
        """What the rows show: the request's latest token, its sequences and their ends (a pruned beam)."""
        state = self.feed.state
        view = state.requests.get(rid) if rid else None
        if view is None:
            return ()
        last = state.last_token_by_request.get(rid, {}).get("seq")
        return last, tuple((s, state.sequences[s].end_step if s in state.sequences else None) for s in view.seq_ids)

    def delta(self, entries: list[LogEntry]) -> bool:
        rid = self.selection.current(self.feed.state)
        if rid != (self.shown[0] if self.shown else None):
            return self.full()  # following the running requests moved on to another one
        if any(e.event.get("request_id") == rid and e.event["type"] in ("token", "seq_fork", "seq_end")
               for e in entries):
            return self.full()  # a new token, or a row more or pruned (a fixed token redraws nothing else)
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
        key = self._row_key(token)
        row = self._row(key, dist)
        mask = Mask(token["masked_mass"], dist.get("masked") or [], token["num_allowed"]) \
            if token.get("num_allowed") is not None else None
        self.legend.set_content(legend_html(LEGEND + (MASK_LEGEND if mask else [])))
        stages = compute_stages(dist["top"], knobs, eos, self.feed.state.model.get("vocab_size", 0), row, mask)
        self.stages = stages
        self.caption.set(self._caption(token, stages, knobs, actual))
        self.cuts.set(cuts_text(stages, knobs))
        recorded = self.feed.state.config.get("dist_top_n") or len(dist["top"])
        self.exactness.set(exactness_text(stages, recorded, key in self.fetching, bool(view and penalised(view.sampling))))
        log = self.log_scale if self.log_scale is not None else \
            max(stages.probs[stages.names[0]], default=1) < AUTO_LOG_BELOW
        self.drawn_log = log
        self.scale.set_value(log)
        series = [{"id": s, "name": stage_name(stages, s), "type": "bar", "color": STAGE_COLORS[s], "barGap": "5%",
                   "data": bar_values([*stages.probs[s], stages.tail[s]], log)} for s in stages.names]
        if knobs == actual:
            final = {t[0]: t[3] for t in dist["top"]}
            series.append({"id": "engine", "name": "engine's final", "type": "scatter", "symbol": "rect",
                           "symbolSize": [14, 3], "color": "#111",
                           "data": bar_values([final.get(t, 0.0) for t in stages.token_ids], log) + [None]})
        # startValue: ECharts grows log-axis bars from 1 (log 0) unless told where they start
        axis = {"type": "log", "min": LOG_MIN, "startValue": LOG_MIN, "max": 1, "name": "probability (log)"} if log \
            else {"type": "value", "min": 0, "startValue": 0, "max": 1, "name": "probability"}
        axis |= {"nameLocation": "middle", "nameGap": 44}  # beside the axis: above it, the legend covers the name
        self.push(self.chart, {"xAxis": {"data": axis_labels(stages, token["token_id"], eos)}, "series": series,
                               "yAxis": axis}, replace_series=True)

    # -- the whole distribution (GET /api/runs/{id}/dist) ------------------------------------------

    def _row_key(self, token: dict) -> RowKey:
        return self.feed.run_id, token["request_id"], token["seq_id"], token["position"]

    def _row(self, key: RowKey, dist: dict) -> np.ndarray | None:
        """The token's whole raw distribution: recorded in its event, or fetched from a run that keeps it; else
        None, and a fetch starts (once)."""
        if key in self.rows:
            return self.rows[key]
        if dist.get("raw_probs_f32"):
            self._keep(key, recorded_row(dist))
            return self.rows[key]
        if key not in self.fetching and self.feed.backend is not None and self.feed.kind != "replay":
            self.fetching.add(key)
            asyncio.get_running_loop().create_task(self._fetch(key))
        return None

    async def _fetch(self, key: RowKey) -> None:
        try:
            answer = await self.feed.backend.token_dist(*key)
        finally:
            self.fetching.discard(key)
        self._keep(key, decode_row(answer["raw_probs_f32"]) if answer else None)
        self.invalidate()

    def _keep(self, key: RowKey, row: np.ndarray | None) -> None:
        self.rows[key] = row
        while len(self.rows) > ROWS_KEPT:
            self.rows.popitem(last=False)

    def _caption(self, token: dict, stages: Stages, knobs: Knobs, actual: Knobs) -> str:
        what_if = "what-if " if knobs != actual else ""
        settings = "greedy" if knobs.greedy else (f"T={knobs.temperature:g} top-k={knobs.top_k} "
                                                  f"top-p={knobs.top_p:g} min-p={knobs.min_p:g}")
        return (f"{self._who(token)} · position {token['position']} · chose {token_label(token['text'])!r} "
                f"({chosen_text(stages, token['token_id'])}) · {what_if}{settings}")

    def _who(self, token: dict) -> str:
        """The request, and which of its sequences when it has several."""
        view = self.feed.state.requests.get(token["request_id"])
        several = view is not None and len(view.seq_ids) > 1
        return f"{token['request_id']} · seq {token['seq_id']}" if several else token["request_id"]

    def _draw_beams(self, token: dict) -> None:
        """A beam token: no distribution was sampled; the candidates kept at that step, by total log-probability."""
        state, history = self.feed.state, self.feed.history
        view = state.requests[token["request_id"]]
        kept = [(seq, t) for seq in view.seq_ids for t in history.seq_tokens.get(seq, ())
                if t.event["step"] == token["step"] and t.cumulative is not None]
        kept.sort(key=lambda k: -k[1].cumulative)
        line = seq_line(state, history, token["seq_id"])
        mine = next((t for _, t in kept if t.event is token), None)
        total = f" · Σ log p {mine.cumulative:.2f}" if mine else ""
        score = f" · score now {line.score:.2f}" if line.score is not None else ""
        self.caption.set(f"{self._who(token)} · position {token['position']} · kept {token_label(token['text'])!r} "
                         f"(log p = {token['logprob']:.2f}){total}{score} · beam search keeps the "
                         f"{view.sampling.get('beam_width')} (beam, token) pairs with the highest total "
                         "log-probability: nothing is sampled")
        data = [{"value": round(t.cumulative, 3),
                 "itemStyle": {"color": BEAM_COLORS["picked" if t.event is token else "other"]}} for _, t in kept]
        labels = [f"seq {seq} + {token_label(t.event['text'])}" for seq, t in kept]
        self.cuts.set("")
        self.exactness.set("")
        self.push(self.chart, {"xAxis": {"data": labels}, "yAxis": {"type": "value", "name": "total log p", "min": None,
                                                                    "startValue": 0, "max": 0},
                               "series": [{"id": "beams", "name": f"beams kept at step {token['step']}",
                                           "type": "bar", "data": data}]}, replace_series=True)

    def _picker(self, lines: list[SeqLine], seq: int | None) -> None:
        """The sequence picker, shown when the request has several."""
        options = {line.seq_id: f"seq {line.seq_id}" + (" ✕" if line.end_reason == "pruned" else "") for line in lines}
        self.seq_picker.set_visibility(len(lines) > 1)
        if options != self.seq_picker.options:
            self.seq_picker.set_options(options, value=seq if seq in options else None)
        elif seq in options and self.seq_picker.value != seq:
            self.seq_picker.set_value(seq)

    def _strip(self, lines: list[SeqLine], seq: int | None, index: int) -> None:
        """One row of text per sequence (unlabelled when the request has just one)."""
        several = len(lines) > 1
        rows = [tokens_html(line, index if line.seq_id == seq else None, several, line.seq_id == seq)
                for line in lines if several or line.seq_id == seq]
        self.strip.set("".join(rows) or '<span class="kv-muted">no tokens yet</span>')
