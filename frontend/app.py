"""The dashboard page: header controls, the new-run drawer, and one or two columns of views.

`/` shows the recent runs and the run library; `/?run=ID` one run; `/?run=A&compare=B` two runs side
by side, driven by the same controls, with their timelines and batch charts zoomed together. A run
the server no longer holds (it left memory, or the server restarted) but saved in its library opens
from there, as a replay at a new address; one it does not know at all gives "No such run". The NiceGUI process
talks to the backend only through `frontend/client.py` (HTTP + the run's websocket).
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

from nicegui import app, ui
from starlette.responses import RedirectResponse

from kvscope.frontend.client import Backend, BackendError, FeedHub, RunFeed
from kvscope.frontend.column import RunColumn
from kvscope.frontend.compare import ComparePanel
from kvscope.frontend.controls import RunControls
from kvscope.frontend.export_menu import ExportMenu
from kvscope.frontend.new_run import NewRunPanel
from kvscope.frontend.palette import for_js
from kvscope.frontend.saved_runs import SavedRuns
from kvscope.frontend.side_by_side import SideBySide

STATIC = Path(__file__).parent / "static"

PAGE_BUILD_TIMEOUT_S = 30.0


def page_url(run_id: str | None, compare: str | None = None) -> str:
    query = {k: v for k, v in (("run", run_id), ("compare", compare)) if v}
    return "/?" + urlencode(query) if query else "/"


def run_state(run: dict) -> str:
    """running, paused, finished or failed, from one entry of `GET /api/runs`."""
    if run.get("failed"):
        return "failed"
    return "finished" if run["finished"] else ("paused" if run["paused"] else "running")


def run_label(run: dict) -> str:
    """A run in the list: its scenario, what kind of run unless a plain one, its state and step."""
    name = run.get("scenario") or run["kind"]
    kind = [run["kind"]] if run["kind"] not in ("scenario", name) else []
    return " · ".join([name, *kind, run_state(run), f"step {max(run['step'], 0)}"])


def head_html() -> str:
    """Palette, the ECharts helpers and the styles, once per page."""
    script = (STATIC / "kvscope.js").read_text(encoding="utf-8")
    css = (STATIC / "kvscope.css").read_text(encoding="utf-8")
    return (f"<script>window.KVSCOPE_COLORS={json.dumps(for_js())};</script>"
            f"<script>{script}</script><style>{css}</style>")


class Dashboard:
    """One browser tab."""

    def __init__(self, backend: Backend, hub: FeedHub, default_model: str | None = None) -> None:
        self.backend = backend
        self.hub = hub
        self.default_model = default_model
        self.columns: list[RunColumn] = []
        self.controls: RunControls | None = None
        self.panel: NewRunPanel | None = None
        self.compare: ComparePanel | None = None
        self.exports: list[ExportMenu] = []
        self.gone_check: ui.timer | None = None
        self.side_by_side: SideBySide | None = None
        self.saved: SavedRuns | None = None

    async def build(self, run_id: str | None, compare: str | None, show_lag: bool = False) -> str | None:
        """Build the page; or, when a run named is gone from the server but saved in its library, open it
        from there and return the address to go to instead (nothing is built then)."""
        runs, runs_error = await self._load_runs()
        run_ids = [r for r in (run_id, compare) if r]
        # An unreachable backend is no proof of absence: watch anyway, the feed reconnects.
        missing = [r for r in run_ids if runs is not None and r not in runs and not self.hub.watching(r)]
        reopened = await self._reopen_saved(missing)
        if reopened:
            return page_url(reopened.get(run_id, run_id), reopened.get(compare, compare) if compare else None)
        if missing:
            run_ids = []
        ui.add_head_html(head_html())
        ui.page_title("kvscope")
        feeds = [self.hub.watch(r, (runs or {}).get(r, {}).get("kind")) for r in run_ids]
        client = ui.context.client
        client.on_delete(lambda: [self.hub.release(f) for f in feeds])
        with ui.left_drawer(value=not feeds).classes("kv-drawer").props("width=340 bordered") as drawer:
            self.panel = NewRunPanel(self.backend, self.open, self.default_model, self.hub.start_when_drawn)
            ui.separator()
            self.compare = ComparePanel(self.panel)
        self._header(drawer, feeds, show_lag)
        with ui.column().classes("w-full kv-main gap-3"):
            if missing:
                self._no_such_run(missing, runs or {})
            elif not feeds:
                self._welcome(runs, runs_error)
            elif len(feeds) == 1:
                self.columns.append(RunColumn(self.backend, feeds[0], compact=False))
            else:
                self.side_by_side = SideBySide(self.backend, feeds)
                self.columns.extend(self.side_by_side.columns)
        if feeds:
            self.gone_check = ui.timer(0.5, lambda: self._reload_if_gone(feeds))
        await self.panel.load()
        if self.saved is not None:
            await self.saved.load()
        if self.controls and runs:
            self.controls.load(runs)
        return None

    async def _reopen_saved(self, missing: list[str]) -> dict[str, str]:
        """The runs the server no longer holds that its library saved, each opened as a replay that plays to
        its end (the run as it was when it finished): old id -> the replay's id."""
        reopened = {}
        for run_id in missing:
            try:
                reopened[run_id] = await self.backend.open_saved(run_id, speed=0, paused=False)
            except BackendError:
                continue  # not in the library either (or none is kept): "No such run"
        return reopened

    async def _load_runs(self) -> tuple[dict[str, dict] | None, str | None]:
        """The server's runs by id, oldest first; or None and why the backend could not say."""
        try:
            return {r["run_id"]: r for r in await self.backend.runs()}, None
        except BackendError as e:
            return None, str(e)

    def _header(self, drawer: ui.left_drawer, feeds: list[RunFeed], show_lag: bool) -> None:
        with ui.header().classes("kv-header items-center gap-2 no-wrap"):
            ui.button(icon="menu", on_click=drawer.toggle).props("flat round dense color=white") \
                .mark("drawer").tooltip("new run, engine configuration, replay a trace")
            ui.link("kvscope", "/").classes("kv-logo")
            if feeds:
                self.controls = RunControls(self.backend, feeds)
            ui.space()
            if show_lag:  # /?lag=1: the latency probe's recent p95 (docs/dashboard.md)
                ui.html('<span id="kvscope-lag" class="kv-lag"></span>', sanitize=False)
            # client side only: the switch works at once, and sessionStorage remembers it (kvscope.js)
            ui.button(icon="co_present").props("flat round dense color=white data-kv=projector") \
                .on("click", js_handler="() => kvscope.toggleProjector()").mark("projector") \
                .tooltip("projector mode: large type for a lecture hall (P)")
            ui.button(icon="keyboard").props("flat round dense color=white data-kv=shortcuts-button") \
                .on("click", js_handler="() => kvscope.shortcutsHelp()").mark("shortcuts-button") \
                .tooltip("keys: space or → continue, P projector, F full screen, ? all of them")
            for feed in feeds:
                self.exports.append(ExportMenu(self.backend, feed, lambda f=feed: self._paused_at(f)))

    def _paused_at(self, feed: RunFeed) -> str | None:
        """The moment this run's lesson guide holds it at (its column is built after the header's menu)."""
        return next((c.guide.paused_at for c in self.columns if c.feed is feed), None)

    def _welcome(self, runs: dict[str, dict] | None, runs_error: str | None) -> None:
        with ui.card().classes("kv-card w-full").props("flat bordered"):
            ui.label("Watch an LLM inference engine think").classes("kv-welcome-title")
            ui.markdown(
                "Pick a **scenario** in the left panel (each one teaches one idea: paged KV blocks, "
                "prefix caching, continuous batching, chunked prefill, preemption, sampling), adjust the "
                "engine if you like, and press **Start run**. Or open a recorded trace, or one of the runs "
                "below. Every view has a **?** that explains what it shows."
            )
            if runs is None:
                ui.label(f"The backend is not reachable: {runs_error}").classes("text-negative")
            else:
                self._run_list(runs)
        if runs is not None:
            self.saved = SavedRuns(self.backend, self.open)

    def _no_such_run(self, missing: list[str], runs: dict[str, dict]) -> None:
        with ui.card().classes("kv-card w-full").props("flat bordered").mark("no-such-run"):
            ui.label(f"No such run: {', '.join(missing)}").classes("kv-welcome-title")
            ui.label("The server does not know this run, nor has it in its run library: a mistyped link, "
                     "or a run deleted from the library.").classes("kv-muted")
            ui.link("← all runs", "/").mark("home-link")
            self._run_list(runs)

    @staticmethod
    def _run_list(runs: dict[str, dict]) -> None:
        if not runs:
            ui.label("No runs yet.").classes("kv-muted")
            return
        ui.label("Recent runs").classes("kv-card-title")
        for r in list(runs.values())[::-1][:20]:  # newest first
            with ui.row().classes("items-baseline gap-2 no-wrap"):
                ui.link(run_label(r), page_url(r["run_id"])).classes("kv-run-link").mark("run-link")
                ui.label(r["run_id"]).classes("kv-muted")

    def _reload_if_gone(self, feeds: list[RunFeed]) -> None:
        """A run the server no longer knows (it restarted): reloading shows "no such run"."""
        if any(f.missing for f in feeds):
            self.gone_check.deactivate()  # once
            ui.navigate.reload()

    def open(self, run_id: str, compare: str | None = None) -> None:
        ui.navigate.to(page_url(run_id, compare))


def make_root(backend: Backend, hub: FeedHub, default_model: str | None = None,
              on_build: Callable[[Dashboard], None] | None = None) -> Callable:
    """The page function for `ui.run(root)`; query parameters arrive as arguments.

    `on_build` sees every tab's Dashboard once built (the tests use it to reach the views)."""

    async def root(run: str = "", compare: str = "", lag: str = "") -> RedirectResponse | None:
        dashboard = Dashboard(backend, hub, default_model)
        redirect = await dashboard.build(run or None, compare or None, show_lag=bool(lag))
        if redirect is not None:
            return RedirectResponse(redirect)
        if on_build is not None:
            on_build(dashboard)
        return None

    return root


def run_dashboard(backend_url: str, host: str = "127.0.0.1", port: int = 8080, token: str | None = None,
                  default_model: str | None = None) -> None:
    """Serve the dashboard in the foreground until Ctrl-C (`kvscope serve`, `python -m kvscope.frontend`)."""
    backend = Backend(backend_url, token)
    hub = FeedHub(backend)
    app.on_startup(_quiet_ctrl_c)
    # Everything imported so far lives as long as the process: keep it out of the collector's full
    # passes, which otherwise stall the event loop for a tenth of a second at a time.
    app.on_startup(gc.freeze)
    # Ctrl-C ends ui.run with KeyboardInterrupt: the caller says what stopped and exits 130.
    # NiceGUI gives a page 3 s to build by default; on a loaded machine the first call to the backend alone
    # took longer, and the tab got a 500 page instead of the dashboard.
    ui.page("/", response_timeout=PAGE_BUILD_TIMEOUT_S)(make_root(backend, hub, default_model))
    ui.run(host=host, port=port, title="kvscope", reload=False,
           show=False, show_welcome_message=False, favicon="🔭", uvicorn_logging_level="warning",
           tailwind=False)  # static/kvscope.css has the few utilities we use


def _quiet_ctrl_c() -> None:
    """Ctrl-C makes uvicorn re-raise SIGINT after its graceful shutdown, which cancels NiceGUI's
    lifespan task and logs that as a failed shutdown with two tracebacks: noise, not news."""
    logging.getLogger("uvicorn.error").addFilter(lambda record: "KeyboardInterrupt" not in record.getMessage())
