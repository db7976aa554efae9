"""What every view shares: the card with its "?" explanation, the timer that pushes deltas.

A view never receives events. Its `ui.timer` (at most 20 Hz) looks at the feed's version: if the
feed resynced (a new snapshot) it redraws everything, otherwise it reads the events it has not
drawn yet from the feed's short log and pushes only what they changed. Many events between two
ticks become one update, so a flood of events costs at most 20 redraws a second, and a view sends
nothing new until the browser has painted its last update (flow control: when the browser is the
bottleneck, events pile up here, where they cost nothing, not as a queue of stale redraws there).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from nicegui import ui

from kvscope.frontend.client import LogEntry, RunFeed

INTEGER_LABELS = {":formatter": "(v) => Number.isInteger(v) ? String(v) : ''"}  # iterations, not -0.5
TICK_S = 0.05  # 20 Hz: smooth to the eye, and a bound on redraws however fast events come
# A view sends its next update only after the browser painted the previous one (or after this long:
# a lost acknowledgement, or no browser at all under NiceGUI's simulated user).
PAINT_TIMEOUT_S = 0.5


class Js(str):
    """A JavaScript expression placed verbatim in an option built by `js()`."""


_JS_MARK = "@@js@@"  # survives json.dumps unescaped


def js(value: Any) -> str:
    """A Python option as a JavaScript expression, with `Js` values left unquoted (functions)."""

    def mark(v: Any) -> Any:
        if isinstance(v, Js):
            return f"{_JS_MARK}{v}{_JS_MARK}"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [mark(x) for x in v]
        return v

    text = json.dumps(mark(value), separators=(",", ":"))
    return re.sub(f'"{_JS_MARK}(.*?){_JS_MARK}"', lambda m: json.loads(f'"{m.group(1)}"'), text)


def legend(items: list[tuple[str, str]], extra_classes: str = "") -> ui.html:
    """A row of colour swatches with labels (HTML, so it reads well when projected)."""
    return ui.html(legend_html(items, extra_classes), sanitize=False)


def legend_html(items: list[tuple[str, str]], extra_classes: str = "") -> str:
    """The legend's HTML, for a view whose legend depends on the run (set_content; unchanged content sends nothing)."""
    html = "".join(  # one nowrap item per entry: a wrapped line never parts a swatch from its label
        f'<span class="kv-legend-item"><span class="kv-swatch" style="background:{color}"></span>'
        f'<span class="kv-legend-label">{label}</span></span>'
        for color, label in items
    )
    return f'<div class="kv-legend {extra_classes}">{html}</div>'


def view_card(title: str, explanation: str, classes: str = "") -> ui.card:
    """A card with a title and a "?" that unfolds the concept behind the view."""
    card = ui.card().classes(f"kv-card {classes}").props("flat bordered")
    with card:
        with ui.row().classes("w-full items-center no-wrap gap-1"):
            ui.label(title).classes("kv-card-title")
            ui.space()
            help_text = ui.markdown(explanation).classes("kv-explain")
            help_text.set_visibility(False)
            ui.button(icon="help_outline", on_click=lambda: help_text.set_visibility(not help_text.visible)) \
                .props("flat round dense size=sm").classes("kv-help").tooltip("What am I looking at?") \
                .mark(f"help-{title}")
        help_text.move(card)  # below the title row, above the content
    return card


class FeedView:
    """Base of the live views: a timer that turns unseen events into one update per tick."""

    name = "view"

    def __init__(self, feed: RunFeed) -> None:
        self.feed = feed
        self.epoch = -1
        self.version = -1
        self.dirty = False  # set by selection changes: redraw fully at the next tick
        self.updates = 0  # pushed updates, for tests
        self._stamp: float | None = None  # receive time of the oldest event in the update being built
        self._unpainted_since: float | None = None  # when the update the browser has not painted was sent
        self.timer = ui.timer(TICK_S, self.tick)
        self.key = self.timer.id  # unique in the page: names this view's paint acknowledgements
        ui.on(f"kvscope_painted_{self.key}", self._on_painted)

    def invalidate(self) -> None:
        self.dirty = True

    def tick(self) -> None:
        feed = self.feed
        if feed.state is None or self._awaiting_paint():
            return
        if feed.epoch != self.epoch or self.dirty:
            self.epoch, self.dirty = feed.epoch, False
            self._stamp = feed.last_recv_ms
            pushed = self.full()
        elif feed.version != self.version:
            entries = feed.since(self.version)
            self._stamp = entries[0].recv_ms if entries else feed.last_recv_ms
            pushed = self.full() if entries is None else self.delta(entries)
        else:
            return
        self.version = feed.version
        self._stamp = None
        if pushed:
            self.updates += 1

    def _awaiting_paint(self) -> bool:
        """Flow control: while the browser is still busy with our last update, events accumulate
        here (cheap) instead of as a queue of redraws in the browser (which is what made it lag)."""
        if self._unpainted_since is None:
            return False
        if time.monotonic() - self._unpainted_since > PAINT_TIMEOUT_S:
            self._unpainted_since = None
            return False
        return True

    def _on_painted(self) -> None:
        self._unpainted_since = None

    def _expect_paint(self) -> str:
        """JavaScript that acknowledges, at the next animation frame, that this update was painted."""
        self._unpainted_since = time.monotonic()
        return f"kvscope.painted({self.key}),"

    def take_stamp(self) -> str:
        """A JavaScript expression that records this tick's latency, to prefix the tick's first update.

        The browser runs it just before applying the update and measures at the next frame, so the
        number is: event received by this process -> painted. Riding along with the update instead
        of a message of its own keeps the number of socket messages down."""
        stamp, self._stamp = self._stamp, None
        return f"kvscope.lat({stamp:.0f},{json.dumps(self.name)})," if stamp else ""

    def stamp_args(self) -> dict:
        """This tick's latency stamp and paint acknowledgement, for a component that sends them itself."""
        stamp, self._stamp = self._stamp, None
        self._unpainted_since = time.monotonic()
        return {"stamp": [round(stamp), self.name] if stamp else None, "ack": self.key}

    def push(self, chart: ui.echart, option: dict[str, Any], replace_series: bool = False) -> None:
        """chart.setOption(option) in the browser, with this tick's latency stamp."""
        # lazyUpdate: ECharts merges the options now but lays out and paints once per frame, so a
        # browser that falls behind coalesces the queued updates instead of redrawing for each.
        opts = '{"lazyUpdate":true,"replaceMerge":["series"]}' if replace_series else '{"lazyUpdate":true}'
        chart.run_chart_method(":setOption", f"({self.take_stamp()}{self._expect_paint()}{js(option)})", opts)

    def full(self) -> bool:
        """Redraw from the feed's state; returns whether anything was sent."""
        raise NotImplementedError

    def delta(self, entries: list[LogEntry]) -> bool:
        """Push what these events changed; by default a full redraw."""
        return self.full()

