"""Speculative decoding: every verify as a row of drafted tokens, accepted or rejected, then the token
the target model added; p against q at a clicked position; tokens per verify against the formula."""

from __future__ import annotations

import html
from typing import Any

from nicegui import ui
from nicegui.events import GenericEventArguments

from kvscope.backend.events.state import RunState
from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.frontend.palette import SPEC_COLORS
from kvscope.frontend.selection import Selection
from kvscope.frontend.views.base import FeedView, legend, view_card
from kvscope.frontend.views.charts import make_chart, probability_bars
from kvscope.frontend.views.live_text import LiveText
from kvscope.frontend.views.sampling import token_label

Event = dict[str, Any]

EXPLANATION = """
A small **draft** (a smaller model, or an **n-gram** lookup in the text so far) proposes *k* tokens;
the target model checks all of them in one forward pass (**verify**) and keeps a prefix of them.
A drafted token x is **accepted** with probability min(1, p(x) / q(x)) (p: the target's
probability, q: the draft's); at the first rejection the target draws a replacement from the
leftover mass max(0, p − q) (**resampled**). If all k pass, the target's distribution after them
gives one more token for free (**bonus**). The output has exactly the target's distribution: only
speed changes.

Each row is one verify: green accepted, red the first rejected (the drafts after it are discarded
unjudged, grey), then the resampled or bonus token. Click a
token to compare p and q at that position. With acceptance rate α per token, a verify appends on
average **(1 − α^(k+1)) / (1 − α)** tokens; the measured number is beside it.
"""

ROWS = 12  # verifies shown, newest first
CLICK_JS = ("(e) => { const d = e.target.closest('[data-i]'); "
            "if (d) emit(Number(d.dataset.v), Number(d.dataset.i)); }")
P_COLOR, Q_COLOR = "#4e79a7", "#f28e2b"
LEGEND = [(SPEC_COLORS["accepted"], "accepted draft"), (SPEC_COLORS["rejected"], "rejected draft"),
          (SPEC_COLORS["discarded"], "discarded (after a rejection)"), (SPEC_COLORS["resampled"], "resampled"),
          (SPEC_COLORS["bonus"], "bonus")]


def expected_tokens_per_verify(alpha: float, k: int) -> float:
    """Leviathan et al. 2023, eq. 1: tokens one verify appends when each draft passes with prob alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def closing_index(e: Event) -> int:
    """Index (from the verify's first position) of the token the target added itself."""
    return e["num_accepted"] if e["resampled_token_id"] is not None else len(e["results"])


def closing_text(e: Event, tokens: list[Event]) -> str:
    """The resampled or bonus token's text: from its token event, else from the dists, else its id."""
    token_id = e["resampled_token_id"] if e["resampled_token_id"] is not None else e["bonus_token_id"]
    position = (e.get("position") or 0) + closing_index(e)
    for t in tokens:
        if t["seq_id"] == e["seq_id"] and t["position"] == position and t["token_id"] == token_id:
            return t["text"]
    dists = e.get("dists") or []
    top = dists[closing_index(e)] if closing_index(e) < len(dists) else []
    return next((text for tid, text, *_ in top if tid == token_id), f"#{token_id}")


def verdict_of(e: Event, index: int) -> tuple[str, str]:
    """(chip kind, words) of a drafted position. Drafts after the first rejection are never judged:
    the target's own token replaces the rest of the draft."""
    if index < e["num_accepted"]:
        return "acc", "accepted"
    if index == e["num_accepted"]:
        return "rej", "rejected"
    return "skip", "discarded after an earlier rejection"


def _chip(kind: str, text: str, v: int, i: int, picked: bool, title: str) -> str:
    cls = f"kv-tok kv-tok-{kind}" + (" kv-tok-picked" if picked else "")
    return (f'<span class="{cls}" data-v="{v}" data-i="{i}" title="{html.escape(title)}">'
            f"{html.escape(token_label(text))}</span>")


def verify_row_html(e: Event, tokens: list[Event], picked: tuple[int, int] | None) -> str:
    """One verify: drafted tokens coloured by the verdict, then the resampled or bonus token."""
    chips = []
    for i, r in enumerate(e["results"]):
        kind, verdict = verdict_of(e, i)
        chips.append(_chip(kind, r.get("text") or f"#{r['token_id']}", e["seq"], i, picked == (e["seq"], i),
                           f"{verdict}: p = {r['p']:.3f}, q = {r['q']:.3f}"))
    if e["resampled_token_id"] is not None or e["bonus_token_id"] is not None:
        kind = "res" if e["resampled_token_id"] is not None else "bonus"
        i = closing_index(e)
        chips.append(_chip(kind, closing_text(e, tokens), e["seq"], i, picked == (e["seq"], i),
                           "resampled from max(0, p − q)" if kind == "res" else "bonus: all drafts accepted"))
    head = f'<span class="kv-spec-head">step {e["step"]} · seq {e["seq_id"]} · pos {e.get("position", "?")}</span>'
    return f'<div class="kv-spec-row">{head}{"".join(chips)}</div>'


def summary_text(state: RunState) -> str:
    """Method, k, acceptance so far, and measured vs expected tokens per verify."""
    spec = state.config.get("speculative") or {}
    k = spec.get("num_tokens", 0)
    method = spec.get("method", "?") + (f" ({spec.get('draft_model')})" if spec.get("method") == "draft" else "")
    totals = state.spec
    parts = [f"{method} · k = {k}", f"{totals.verifies} verifies"]
    if totals.acceptance_rate is not None:
        parts.append(f"accepted {totals.accepted}/{totals.proposed} drafted = {100 * totals.acceptance_rate:.0f}%")
    alpha = (state.metrics or {}).get("spec_alpha")
    measured = totals.tokens_per_verify
    if measured is not None:
        parts.append(f"tokens per verify {measured:.2f}")
    if alpha is not None:
        parts.append(f"α = {alpha:.2f}: expected (1 − α^{k + 1}) / (1 − α) = "
                     f"{expected_tokens_per_verify(alpha, k):.2f}")
        drafted = totals.proposed / totals.verifies if totals.verifies else k
        if drafted < k - 0.005:  # why measured and expected part: the formula's k drafts were not all made
            parts.append(f"the formula assumes {k} drafts at every verify and each passing independently; these "
                         f"verifies drafted {drafted:.2f} on average (a lookup that finds nothing drafts none)")
    return " · ".join(parts)


def pq_bars(e: Event, index: int) -> tuple[list[str], list[float], list[float]]:
    """Labels, p and q at one verified position: the top tokens in `dists`, or the drafted one alone."""
    dists = e.get("dists") or []
    if index < len(dists):
        top = dists[index]
        return [token_label(text) for _, text, *_ in top], [p for *_, p, _ in top], [q for *_, q in top]
    r = e["results"][index]
    return [token_label(r.get("text") or f"#{r['token_id']}")], [r["p"]], [r["q"]]


class SpeculativeView(FeedView):
    name = "speculative"

    def __init__(self, feed: RunFeed, selection: Selection, height: str = "220px") -> None:
        self.selection = selection
        self.picked: tuple[int, int] | None = None  # (the verify's event seq, index of the position)
        self.shown: tuple | None = None
        with view_card("Speculative decoding: draft, verify, accept", EXPLANATION, "w-full"):
            self.caption = LiveText().classes("kv-caption").mark("spec-caption")
            with ui.column().classes("w-full gap-1") as self.body:  # hidden in runs without speculation
                legend(LEGEND)
                self.rows = LiveText(html=True).classes("w-full").mark("spec-rows")
                self.rows.on("click", self._on_click, js_handler=CLICK_JS)
                self.pq_caption = LiveText().classes("kv-caption").mark("spec-pq-caption") \
                    .props("data-kv=spec-pq-caption")  # for the browser test
                self.chart = make_chart(probability_bars(28, 56), height, "spec-pq")
        selection.on_change(self.invalidate)
        super().__init__(feed)

    def pick(self, verify_seq: int, index: int) -> None:
        """Show p vs q at position `index` of the verify whose event number is `verify_seq`."""
        self.picked = (verify_seq, index)
        self.invalidate()

    def _on_click(self, e: GenericEventArguments) -> None:
        if isinstance(e.args, list) and len(e.args) == 2:
            self.pick(int(e.args[0]), int(e.args[1]))

    def _verifies(self) -> tuple[str | None, list[Event]]:
        rid = self.selection.current(self.feed.state)
        return rid, list(self.feed.history.verifies.get(rid, ())) if rid else []

    # -- drawing -----------------------------------------------------------------------------------

    def full(self) -> bool:
        state = self.feed.state
        if not state.config.get("speculative"):
            return self._off()
        rid, verifies = self._verifies()
        key = (rid, verifies[-1]["seq"] if verifies else None, self.picked, state.spec.verifies,
               (state.metrics or {}).get("spec_alpha"))
        if key == self.shown:
            return False
        self.shown = key
        self.body.set_visibility(True)
        self.caption.set(summary_text(state))
        tokens = list(self.feed.history.tokens.get(rid, ())) if rid else []
        rows = [verify_row_html(e, tokens, self.picked) for e in verifies[::-1][:ROWS]]
        self.rows.set("".join(rows) or f'<span class="kv-muted">{html.escape(rid or "No request")}: '
                                       "no verify yet</span>")
        self._draw_pq(rid, verifies)
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        if any(e.event["type"] in ("spec_verify", "metrics") for e in entries):
            return self.full()
        return False

    def _off(self) -> bool:
        if self.shown == ("off",):
            return False
        self.shown = ("off",)
        self.caption.set("No speculative decoding in this run (engine.speculative is off).")
        self.body.set_visibility(False)
        return True

    def _draw_pq(self, rid: str | None, verifies: list[Event]) -> None:
        chosen = next((e for e in verifies if self.picked and e["seq"] == self.picked[0]), None)
        if chosen is None:  # nothing clicked (or it scrolled out): the newest verify's first position
            chosen, index = (verifies[-1], 0) if verifies else (None, 0)
        else:
            index = self.picked[1]
        if chosen is None or index >= max(len(chosen["results"]), len(chosen.get("dists") or [])):
            self.pq_caption.set("Click a token of a row to compare p and q there.")
            self.push(self.chart, {"xAxis": {"data": []}, "series": []}, replace_series=True)
            return
        labels, p, q = pq_bars(chosen, index)
        self.pq_caption.set(self._pq_caption(chosen, index))
        series = [{"id": "p", "name": "p (target)", "type": "bar", "color": P_COLOR, "data": [round(x, 4) for x in p]},
                  {"id": "q", "name": "q (draft)", "type": "bar", "color": Q_COLOR, "data": [round(x, 4) for x in q]}]
        self.push(self.chart, {"xAxis": {"data": labels}, "series": series}, replace_series=True)

    @staticmethod
    def _pq_caption(e: Event, index: int) -> str:
        where = f"{e['request_id']} · step {e['step']} · position {(e.get('position') or 0) + index}"
        if index < len(e["results"]):
            r = e["results"][index]
            verdict = verdict_of(e, index)[1]
            return (f"{where}: drafted {token_label(r.get('text') or '')!r}, p = {r['p']:.3f}, q = {r['q']:.3f}, "
                    f"kept with probability min(1, p/q) = {min(1.0, r['p'] / r['q']) if r['q'] else 1.0:.2f}: "
                    f"{verdict}")
        expected = e.get("expected_accept") or []
        overlap = f" · Σ min(p, q) per drafted position: {', '.join(f'{a:.2f}' for a in expected)}" \
            if expected else ""
        return f"{where}: the target's own distribution (bonus position){overlap}"
