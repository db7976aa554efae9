"""Two runs side by side: titles that say what differs, a row of differences, one x scale, one lesson.

The titles come from a diff of the two runs' header settings (backend/events/compare.py), never
from what the compare form asked for, so a pair opened from a link or two replays is titled just
as truthfully. The row of differences leads with both runs priced on each column's modelled hardware
(frontend/hardware.py), then the settings' bytes and counts, and last the engine times measured on this
CPU: a shared machine's wall clock can say the opposite of the lesson. The titles and that row stay
under the page header while the columns scroll; a pair that differs in block size gets a figure of
what the size costs in bookkeeping (views/block_cost.py). The per-iteration charts of both columns
share one x range, the longer run's iterations so far: a run that needs more iterations visibly
reaches further right.

A lesson scenario's pair is taught together: each column has its run's lesson card, and when one run
stops at a moment its lesson explains, the other is held where it is (a line above the columns says
which side reached what), so the class looks at one moment at a time; "continue" on either card goes
on with both. A run's "finished" holds nothing: the other side still has its own way to go.
"""

from __future__ import annotations

import html
from typing import Any

from nicegui import ui

from kvscope.backend.events.compare import Row, compare_rows, setting_differences
from kvscope.backend.events.record import RunRecord
from kvscope.backend.perf.hardware import THIS_MACHINE
from kvscope.frontend.client import Backend, BackendError, RunFeed
from kvscope.frontend.column import RunColumn, sync_zoom
from kvscope.frontend.compare import AXES
from kvscope.frontend.hardware import HardwareChoice, ModelledRun
from kvscope.frontend.lesson import MOMENT_TITLES, LessonGuide
from kvscope.frontend.saved_runs import SavePair
from kvscope.frontend.new_run import MODELS
from kvscope.frontend.views.block_cost import BlockCostFigure
from kvscope.frontend.views.block_pool import pool_bytes, pool_text
from kvscope.frontend.views.live_text import LiveText

SCALE_GROUP = "side-by-side"  # the block pools' common scale (block_pool.js)
LABELS = {axis.path: axis.label for axis in AXES.values()}
VALUE_NAMES = {axis.path: axis.values for axis in AXES.values() if axis.values and axis.path != "engine.speculative"}
TICK_S = 0.5
HOLD_TICK_S = 0.05  # as often as the lesson cards look for moments: the other run is held within a tick


def setting_label(path: str) -> str:
    """How the page names a setting: the compare form's name, else its last part in words."""
    return LABELS.get(path) or path.rsplit(".", 1)[-1].replace("_", " ")


def value_name(path: str, value: Any) -> str:
    """A setting's value in words (on / off, a model's variant, a speculative method with its k)."""
    if path == "model":
        return MODELS.get(value, str(value))
    if isinstance(value, dict) and "method" in value:  # engine.speculative
        drafter = f"draft model {value.get('draft_model')}" if value["method"] == "draft" else "n-gram"
        return f"{drafter}, k = {value.get('num_tokens')}"
    if path == "engine.disaggregation":
        return "colocated" if value is None else \
            f"disaggregated ({value.get('prefill_instances')} + {value.get('decode_instances')})"
    names = VALUE_NAMES.get(path, {})  # the compare form's words ("model dtype", "compiled")
    if isinstance(value, (str, int, float)) and value in names:
        return names[value]
    if isinstance(value, bool) or value is None:
        return "on" if value else "off"
    return str(value)


def side_titles(a: RunRecord, b: RunRecord) -> tuple[str, str]:
    """Each run's title: the settings in which it differs from the other ("prefix caching: on")."""
    diffs = setting_differences(a, b)
    if not diffs:
        return "same settings", "same settings"
    return tuple(" · ".join(f"{setting_label(p)}: {value_name(p, v[i])}" for p, *v in diffs) for i in (0, 1))


def figure_text(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit and abs(value) < 10:  # a modelled GPU time is a fraction of a millisecond: keep 3 digits
        return f"{value:.3g} {unit}"
    return f"{value:,.1f} {unit}" if unit else f"{value:,.0f}"


def significant(value: float | None, digits: int = 4) -> float | None:
    """Rounded to a few significant digits, so that two equal figures compare equal (and are not bold)."""
    return None if value is None else float(f"{value:.{digits}g}")


def hardware_name(choice: HardwareChoice) -> str:
    """The column's hardware in a few letters, for the row's labels ("H100", "2 × A100-80GB")."""
    name = "this machine" if choice.name == THIS_MACHINE else choice.name.upper()
    return f"{choice.tp} × {name}" if choice.tp > 1 else name


def modelled_rows(records: tuple[RunRecord, RunRecord], runs: list[ModelledRun | None],
                  hardware: tuple[str, str]) -> list[Row]:
    """The headline: each run priced on its column's hardware (None where it cannot be modelled yet)."""
    where = hardware[0] if hardware[0] == hardware[1] else " / ".join(hardware)
    latency = [run.latency(r.state, r.history) if run is not None else None for r, run in zip(records, runs)]

    def ms(seconds: list[float | None]) -> list[float | None]:
        return [significant(s * 1e3) if s is not None else None for s in seconds]

    return [
        Row(f"tokens/s (modelled, {where})", *(significant(x.tokens_per_s) if x else None for x in latency)),
        Row(f"mean TTFT (modelled, {where})", *ms([x.ttft_s if x else None for x in latency]), "ms"),
        Row(f"mean TPOT (modelled, {where})", *ms([x.tpot_s if x else None for x in latency]), "ms"),
        Row(f"time for the run (modelled, {where})", *ms([run.total_s if run and run.steps else None
                                                          for run in runs]), "ms"),
    ]


def differences_html(rows: list[Row], titles: tuple[str, str]) -> str:
    """The row of differences: a column per figure in which the runs differ (in bold), a line per run; the
    figures they share in one line under it (a dozen equal columns pushed the differing ones off a
    projector's width)."""
    differ, same = [r for r in rows if r.a != r.b], [r for r in rows if r.a == r.b]
    head = "".join(f"<th>{html.escape(r.label)}</th>" for r in differ)
    lines = []
    for i, title in enumerate(titles):
        cells = "".join(f'<td class="kv-differs">{figure_text((r.a, r.b)[i], r.unit)}</td>' for r in differ)
        lines.append(f'<tr><th class="kv-side-run">{html.escape(title)}</th>{cells}</tr>')
    shared = " · ".join(f"{html.escape(r.label)} {figure_text(r.a, r.unit)}" for r in same)
    return (f'<table class="kv-side-table"><tr><th></th>{head}</tr>{"".join(lines)}</table>'
            + (f'<div class="kv-side-same" data-kv="side-same">the same in both: {shared}</div>' if same else ""))


def scale_notes(a: RunRecord, b: RunRecord) -> tuple[str, str]:
    """What each pool's caption says of the common scale: its bytes against the other's, so that a pool
    drawn smaller reads as less memory (MHA against GQA: same blocks, 4x the bytes)."""
    if not all(pool_bytes(r.state) for r in (a, b)):
        return "", ""  # no cache on one side: nothing to scale against
    sizes = [pool_text(r.state) for r in (a, b)]
    return tuple(f"drawn to scale with the other pool (equal area, equal bytes): {sizes[i]} here, "
                 f"{sizes[1 - i]} there" for i in (0, 1))


def hold_text(titles: tuple[str, str], guides: list[LessonGuide], held: set[int]) -> str:
    """Which side reached which moment, and which side waits for it ("" when nobody holds)."""
    parts = [f"{titles[i]} reached “{MOMENT_TITLES[g.moment.kind]}” at iteration {g.moment.step}"
             for i, g in enumerate(guides) if holds(g)]
    parts += [f"{titles[i]} is held at iteration {guides[i].feed.state.step} until continue" for i in sorted(held)]
    return " · ".join(parts)


def holds(guide: LessonGuide) -> bool:
    """Whether the guide's run is stopped at a moment that holds the other side too (not its finish)."""
    return guide.moment is not None and guide.moment.kind != "finished"


def shared_x(records: list[RunRecord]) -> dict[str, Any]:
    """The x range in iterations both columns' charts show: every run's iterations so far."""
    last = max((r.state.step for r in records), default=0)
    return {"min": -0.5, "max": max(last, 0) + 0.5}


class SideBySide:
    """The compare layout: titles, the differences, then a column per run (compact views)."""

    def __init__(self, backend: Backend, feeds: list[RunFeed]) -> None:
        self.feeds = feeds
        self.sent: dict[int, tuple] = {}  # chart id -> the x range it was last given
        self.rooflines_sent: list[tuple] = [(), ()]  # per column: what it last got of the other's points
        with ui.element("div").classes("kv-compare w-full"):
            # titles and differences stay under the page header while the columns scroll (kvscope.css)
            with ui.element("div").classes("kv-compare-sticky").mark("side-sticky"):
                self.titles = [LiveText(f.run_id).classes("kv-side-title").mark(f"side-title-{i}")
                               for i, f in enumerate(feeds)]
                self.differences = LiveText(html=True).classes("kv-side-diff").mark("side-differences")
            self.hold_line = LiveText().classes("kv-side-diff").mark("side-hold") \
                .style("font-weight:600;border-left:4px solid #f59e0b")
            self.hold_line.set_visibility(False)
            self.block_cost = BlockCostFigure()  # a card across both columns, when the block sizes differ
            self.save_pair = SavePair(backend, (feeds[0].run_id, feeds[1].run_id))
            self.columns: list[RunColumn] = []
            self.guides: list[LessonGuide] = []
            for i, feed in enumerate(feeds):
                with ui.column().classes("gap-3 w-full min-w-0"):
                    column = RunColumn(backend, feed, compact=True)
                    self.columns.append(column)
                    self.guides.append(self._guide(backend, column, i))
        for column in self.columns:
            column.views["blocks"].draw_to_scale(SCALE_GROUP)
        for name in ("timeline", "batch"):
            sync_zoom([c.views[name].chart for c in self.columns])
        self.backend = backend
        self.held: set[int] = set()  # the columns whose run this page paused for the other's moment
        self.showing = [False, False]  # whether each card showed its continue at the last tick
        self.titles_now: tuple[str, str] = ("", "")
        self.timer = ui.timer(TICK_S, self.refresh)
        ui.timer(HOLD_TICK_S, self.hold_together)

    def _guide(self, backend: Backend, column: RunColumn, i: int) -> LessonGuide:
        """The run's lesson card, first in its column."""
        guide = LessonGuide(backend, column.feed, column.views, column.selection)
        guide.card.move(target_index=0)
        guide.next.mark(f"lesson-continue side-continue-{i}")
        return guide

    async def continue_together(self) -> None:
        """A continue on one card (its button gone) goes on with the other card's step too, if that shows
        one (the start, or a moment that holds): one continue for both sides. Watched here, not as a second
        click listener: the button hides on the first, and NiceGUI drops events of a hidden element."""
        showing = [g.next.visible for g in self.guides]
        for i, other in ((0, self.guides[1]), (1, self.guides[0])):
            if self.showing[i] and not showing[i] and showing[1 - i] and (other.moment is None or holds(other)):
                await other.resume()
        self.showing = [g.next.visible for g in self.guides]

    async def hold_together(self) -> None:
        """While a run is stopped at a moment, the other is paused; once none is, the held one resumes."""
        await self.continue_together()
        holding = any(holds(g) for g in self.guides)
        for i, guide in enumerate(self.guides):
            state = guide.feed.state
            if state is None or state.finished:
                self.held.discard(i)
                continue
            if holding and not holds(guide) and i not in self.held and not guide.feed.pacing.paused:
                self.held.add(i)
                await self._control(i, "pause")
            elif not holding and i in self.held:
                self.held.discard(i)
                await self._control(i, "resume")
        text = hold_text(self.titles_now, self.guides, self.held)
        self.hold_line.set(text)
        if self.hold_line.visible != bool(text):
            self.hold_line.set_visibility(bool(text))

    async def _control(self, i: int, action: str) -> None:
        feed = self.feeds[i]
        try:
            await self.backend.control(feed.run_id, action)
        except BackendError as e:
            ui.notify(f"side by side: {e}", type="warning")
            return
        feed.pacing.paused = action == "pause"  # at once: a replay records no control event

    def refresh(self) -> None:
        records = [f.record for f in self.feeds]
        if any(r is None for r in records):
            return
        titles = self.titles_now = side_titles(*records)
        for label, title in zip(self.titles, titles):
            label.set(title)
        runs = [c.hardware.modelled() for c in self.columns]
        hardware = (hardware_name(self.columns[0].hardware), hardware_name(self.columns[1].hardware))
        rows = modelled_rows((records[0], records[1]), runs, hardware) + compare_rows(*records)
        self.differences.set(differences_html(rows, titles))
        self.block_cost.show((records[0], records[1]), titles)
        for column, note in zip(self.columns, scale_notes(*records)):
            column.views["blocks"].set_scale_note(note)
        self._share_x(shared_x(records))
        self._share_rooflines(titles)

    def _share_rooflines(self, titles: tuple[str, str]) -> None:
        """Each roofline also draws the other run's points (hollow), so both stand against the same roofs."""
        for i, column in enumerate(self.columns):
            other = self.columns[1 - i].views["roofline"]
            key = (len(other.points), other.hardware.label, titles[1 - i])
            if self.rooflines_sent[i] != key:
                self.rooflines_sent[i] = key
                column.views["roofline"].show_other(list(other.points), titles[1 - i], other.hardware.label)

    def _share_x(self, x: dict[str, Any]) -> None:
        """Give every per-iteration chart the shared range (the timeline only while in iterations)."""
        for column in self.columns:
            timeline = column.views["timeline"]
            self._set_x(timeline.chart, x if timeline.axis == "iterations" else {"min": "dataMin", "max": "dataMax"}, 1)
            self._set_x(column.views["batch"].chart, x, 2)
            self._set_x(column.views["metrics"].chart, x, 2)

    def _set_x(self, chart: ui.echart, x: dict[str, Any], axes: int) -> None:
        key = (x["min"], x["max"])
        if self.sent.get(chart.id) == key:
            return
        self.sent[chart.id] = key
        chart.run_chart_method("setOption", {"xAxis": x if axes == 1 else [x] * axes})
