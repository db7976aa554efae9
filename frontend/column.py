"""One run's column of views: its title and engine, the request picker, a prompt box, the views."""

from __future__ import annotations

from collections.abc import Callable

from nicegui import ui
from nicegui.events import GenericEventArguments

from kvscope.frontend.client import Backend, RunFeed
from kvscope.frontend.controls import PromptBox
from kvscope.frontend.grammar_position import tagged
from kvscope.frontend.hardware import HardwareChoice, HardwarePicker
from kvscope.frontend.lesson import LessonGuide
from kvscope.frontend.selection import Selection
from kvscope.frontend.text import md_escape, request_text
from kvscope.frontend.views.attention import AttentionView
from kvscope.frontend.views.batch import BatchView
from kvscope.frontend.views.block_pool import BlockPoolView
from kvscope.frontend.views.block_table import BlockTableView
from kvscope.frontend.views.kv_calc import KvCalculatorView
from kvscope.frontend.views.metrics import MetricsView
from kvscope.frontend.views.roofline import RooflineView
from kvscope.frontend.views.sampling import SamplingView
from kvscope.frontend.views.speculative import SpeculativeView
from kvscope.frontend.views.timeline import TimelineView

FOLLOW = ""  # request picker value: follow the running requests


class RunColumn:
    """Every view of one run. `compact`: the side-by-side layout (fewer, shorter views)."""

    def __init__(self, backend: Backend, feed: RunFeed, compact: bool) -> None:
        self.feed = feed
        self.compact = compact
        self.selection = Selection()
        self.hardware = HardwareChoice(feed)
        self.views: dict[str, object] = {}
        self._request_bar(backend)
        if compact:
            self._compact()
        else:
            self.guide = LessonGuide(backend, feed, self.views, self.selection)
            self._full()
        self._refresh_requests()
        self.selection.on_change(self._show_selection)
        ui.timer(0.5, self._refresh_requests)

    def _request_bar(self, backend: Backend) -> None:
        # Side by side a column is half the page: its pickers wrap under the title rather than overflow.
        with ui.row().classes(f"w-full items-end gap-3 {'flex-wrap' if self.compact else 'no-wrap'}"):
            with ui.column().classes("gap-0"):
                self.title = ui.label(self.feed.run_id).classes("kv-run-title").mark("run-title")
                self.engine = ui.label("").classes("kv-caption").mark("run-engine")
                self.simulated = ui.label("simulated: no weights ran, times are modelled").classes("kv-caption") \
                    .mark("run-simulated")
                self.simulated.set_visibility(False)
            ui.space()
            HardwarePicker(self.hardware)
            self.picker = ui.select({FOLLOW: "follow running"}, value=FOLLOW, label="request",
                                    on_change=self._on_pick).classes("w-44").props("dense").mark("request-picker")
        # the scenario's description on a line of its own: beside the title and pickers, a docked lesson
        # card left it a column a few words wide
        self.lesson = ui.markdown("").classes("kv-small kv-lesson w-full").mark("run-lesson")
        self.lesson.set_visibility(not self.compact)  # side by side: the columns differ in engine only
        # the selected request's own text: what a lesson reads out (prompt, reply, how it ended)
        self.request_text = ui.label("").classes("kv-caption kv-request-text w-full").mark("request-text")
        with ui.element("div").classes("w-full") as self.prompt_row:
            self.prompt = PromptBox(backend, self.feed)  # hidden for replays, which take no requests

    def _full(self) -> None:
        feed, sel = self.feed, self.selection
        with ui.element("div").classes("kv-grid w-full"):
            self.views["blocks"] = BlockPoolView(feed, sel)
            self.views["timeline"] = TimelineView(feed, sel, self.hardware)
            self.views["batch"] = BatchView(feed, sel)
            self.views["metrics"] = MetricsView(feed, self.hardware)
            with ui.column().classes("gap-3 w-full"):
                self.views["block_table"] = BlockTableView(feed, sel)
                self.views["attention"] = AttentionView(feed, sel, height="260px")
            self.views["sampling"] = SamplingView(feed, sel)
            self.views["speculative"] = SpeculativeView(feed, sel)
            self.views["roofline"] = RooflineView(feed, self.hardware)
        self.views["kv_calc"] = KvCalculatorView(feed)

    def _compact(self) -> None:
        feed, sel = self.feed, self.selection
        self.views["blocks"] = BlockPoolView(feed, sel, height="180px")
        self.views["timeline"] = TimelineView(feed, sel, self.hardware, height="260px")
        self.views["batch"] = BatchView(feed, sel, height="240px")
        self.views["metrics"] = MetricsView(feed, self.hardware, height="240px")
        # Each column's roofline also draws the other run's points (side_by_side.py): one pair of roofs
        self.views["roofline"] = RooflineView(feed, self.hardware, height="240px")

    def _show_selection(self) -> None:
        """A request picked in any view is the picker's value too."""
        rid = self.selection.request_id
        if rid is not None and rid not in self.picker.options:
            self.picker.set_options({**self.picker.options, rid: rid})
        if self.picker.value != (rid or FOLLOW):
            self.picker.set_value(rid or FOLLOW)
        self._show_request_text()

    def _on_pick(self) -> None:
        self.selection.select_request(self.picker.value or None)

    def _show_request_text(self) -> None:
        state, rid = self.feed.state, self.selection.request_id
        view = state.requests.get(rid) if state is not None and rid is not None else None
        text = request_text(view, state, self.feed.history) if view is not None else ""
        if text != self.request_text.text:
            self.request_text.set_text(text)
        self.request_text.set_visibility(bool(text))

    def _refresh_requests(self) -> None:
        self.prompt_row.set_visibility(self.feed.kind != "replay")
        self._show_request_text()
        state = self.feed.state
        if state is None:
            return
        if len(self.picker.options) != len(state.requests) + 1:
            names = {r: tagged(r, view.sampling) for r, view in state.requests.items()}  # a grammar's kind shown
            self.picker.set_options({FOLLOW: "follow running", **names},
                                    value=self.picker.value if self.picker.value in state.requests else FOLLOW)
        scenario = state.scenario or {}
        # which model ran (a scenario with a fallback_model says so here); a folder by its last part
        model = str(state.model.get("name") or "").rstrip("/").rsplit("/", 1)[-1]
        title = f"{scenario.get('name') or self.feed.kind}{f' on {model}' if model else ''} · {self.feed.run_id}"
        summary = engine_summary(state.config, state.cache)  # the header may come after the first refresh
        if summary != self.engine.text:
            self.engine.set_text(summary)
        if state.simulated != self.simulated.visible:
            self.simulated.set_visibility(state.simulated)
        if title != self.title.text:
            self.title.set_text(title)
            self.lesson.set_content(md_escape(scenario.get("description") or ""))  # the lesson has its own card


def engine_summary(config: dict, cache: dict) -> str:
    """The engine settings a lesson turns on, in one line (side by side, they tell the columns apart)."""
    parts = [f"{config.get('batching', '?')} batching", f"{config.get('kv_layout', '?')} KV",
             "prefix caching" if config.get("prefix_caching") else "no prefix caching",
             f"chunked prefill ({config.get('max_num_batched_tokens')} tokens)" if config.get("chunked_prefill")
             else f"budget {config.get('max_num_batched_tokens')} tokens",
             f"{cache.get('num_blocks')} blocks × {cache.get('block_size')}", f"{config.get('max_num_seqs')} seqs"]
    if not config.get("kv_cache", True):
        parts.insert(1, "KV cache OFF")
    spec = config.get("speculative")
    if spec:
        drafter = spec.get("draft_model") if spec.get("method") == "draft" else "n-gram"
        parts.append(f"speculative {drafter}, k = {spec.get('num_tokens')}")
    if config.get("weight_quant", "none") != "none":
        parts.append(f"weights {config['weight_quant']}")
    if config.get("kv_cache_dtype", "auto") != "auto":
        parts.append(f"KV {config['kv_cache_dtype']}")
    if config.get("tensor_parallel", 1) > 1:
        parts.append(f"tensor parallel over {config['tensor_parallel']} ranks")
    return " · ".join(parts)


def sync_zoom(charts: list[ui.echart]) -> None:
    """Zooming one chart zooms the others (the side-by-side columns stay aligned)."""
    last: dict[int, tuple] = {}

    def handler(source: ui.echart) -> Callable[[GenericEventArguments], None]:
        def on_zoom(e: GenericEventArguments) -> None:
            args = e.args if isinstance(e.args, dict) else {}
            batch = args.get("batch") or [args]
            start, end = batch[0].get("start"), batch[0].get("end")
            if start is None or end is None:
                return
            key = (round(start, 2), round(end, 2))
            for chart in charts:
                if chart is source or last.get(chart.id) == key:
                    continue
                last[chart.id] = key
                chart.run_chart_method("dispatchAction", {"type": "dataZoom", "start": start, "end": end})
            last[source.id] = key
        return on_zoom

    for chart in charts:
        chart.on("chart:datazoom", handler(chart), ["start", "end", "batch"])
