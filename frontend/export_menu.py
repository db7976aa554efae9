"""The export menu: PNG / SVG of a view, a GIF of the run and a Perfetto trace (rendered server-side by the
`frontend.export` package from the run's trace), the trace itself as JSONL, and for a lesson the moment it
is paused at (a PNG) and, once the run is finished, the whole lesson as an HTML handout. Those two are
enabled only when they can be made; the menu checks each time it opens.

Rendering runs in a worker thread (NiceGUI's run.io_bound) so the page stays live; the renderer reports
each frame, and a progress bar beside the button follows it (from the event loop: the worker only
schedules the update), then names the file it handed to the browser."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from nicegui import run, ui

from kvscope.frontend.client import Backend, BackendError, RunFeed
from kvscope.frontend.lesson import lesson_steps

VIEWS = {"timeline": "Timeline", "blocks": "Block pool", "batch": "Batch composition"}
KINDS = {".png": "PNG", ".svg": "SVG", ".json": "Perfetto JSON", ".gif": "GIF", ".html": "HTML"}
LESSON_TITLES = {"moment": "this moment", "handout": "lesson handout"}  # the status line's words


def parse_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def render_bytes(events: list[dict], view: str, suffix: str, progress: Callable[[float], None] | None = None,
                 moment: str | None = None) -> bytes:
    """The picture (Perfetto JSON, handout) of one view as bytes, through a temporary file."""
    from kvscope.frontend.export import render  # matplotlib loads on the first export only

    with tempfile.TemporaryDirectory(prefix="kvscope-export-") as folder:
        out = Path(folder) / f"{view}{suffix}"
        render(events, view, out, moment=moment, progress=progress)
        return out.read_bytes()


def handout_ready(feed: RunFeed) -> bool:
    """A handout is made from a finished run whose scenario has a lesson."""
    state = feed.state
    return state is not None and state.finished and bool(lesson_steps(state.scenario))


class ExportMenu:
    """`paused_at()` is the moment kind the page's lesson guide holds the run at, or None (the run column
    owns the guide; the menu sits in the header)."""

    def __init__(self, backend: Backend, feed: RunFeed, paused_at: Callable[[], str | None] = lambda: None) -> None:
        self.backend, self.feed, self.paused_at = backend, feed, paused_at
        self.run_id = feed.run_id
        self.last: tuple[str, int] | None = None  # (filename, size) of the last export, for tests
        self.busy = False
        # one line that gives way, however long the file's name: the header never wraps, and in projector mode at
        # 1280 px the export button beside it would be pushed off the screen (the whole name shows on hover)
        with ui.row().classes("items-center gap-2 no-wrap min-w-0").mark("export-status") as self.status:
            self.status_label = ui.label().classes("text-white text-body2 ellipsis").style("max-width: 14rem") \
                .props("data-kv=export-status-label").mark("export-status-label")
            self.progress = ui.linear_progress(value=0, show_value=False, size="10px", color="amber-5") \
                .props("track-color=blue-grey-8 rounded data-kv=export-progress") \
                .classes("w-40").mark("export-progress")
        self.status.set_visibility(False)
        button = ui.button(icon="download").props("flat round color=white data-kv=export").tooltip("export")
        with button.mark("export"):
            with ui.menu().mark("export-menu").on_value_change(self.refresh) as self.menu:
                for view, title in VIEWS.items():
                    for suffix in (".png", ".svg"):
                        ui.menu_item(f"{title} {suffix[1:].upper()}",
                                     lambda v=view, s=suffix: self.export(v, s)).mark(f"export-{view}{suffix}")
                ui.menu_item("Timeline as Perfetto JSON", lambda: self.export("timeline", ".json")) \
                    .mark("export-perfetto")
                ui.menu_item("Run as GIF (block pool + timeline)", lambda: self.export("blocks", ".gif")) \
                    .mark("export-gif")
                ui.menu_item("Trace JSONL", self.download_trace).mark("export-trace")
                ui.separator()
                self.moment_item = ui.menu_item("This moment (PNG)", self.export_moment).mark("export-moment")
                self.handout_item = ui.menu_item("Handout (HTML)", lambda: self.export("handout", ".html")) \
                    .mark("export-handout")
        self.refresh()

    def refresh(self) -> None:
        """Enable the lesson's exports that can be made now."""
        self.moment_item.set_enabled(self.paused_at() is not None)
        self.handout_item.set_enabled(handout_ready(self.feed))

    async def export_moment(self) -> bytes | None:
        kind = self.paused_at()
        if kind is None:  # the run went on between opening the menu and the click
            ui.notify("the lesson is no longer paused at a moment", type="warning")
            return None
        return await self.export("moment", ".png", kind)

    async def _trace(self) -> str | None:
        try:
            return await self.backend.trace(self.run_id)
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return None

    def _file_name(self, view: str, suffix: str, moment: str | None = None) -> str:
        what = f"moment-{moment}" if moment else {".json": "perfetto", ".gif": "run"}.get(suffix, view)
        return f"kvscope-{self.run_id}-{what}{suffix}"

    async def export(self, view: str, suffix: str, moment: str | None = None) -> bytes | None:
        if self.busy:
            ui.notify("an export is still rendering", type="warning")
            return None
        text = await self._trace()
        if text is None:
            return None
        title = LESSON_TITLES.get(view) or VIEWS[view].lower()
        what = "run GIF" if suffix == ".gif" else f"{title} {KINDS[suffix]}"
        self.busy = True
        self._show(f"rendering {what}", 0.0)
        loop = asyncio.get_running_loop()
        try:
            data = await run.io_bound(render_bytes, parse_jsonl(text), view, suffix,
                                      lambda f: loop.call_soon_threadsafe(self.progress.set_value, round(f, 3)), moment)
        except (ValueError, ImportError) as e:  # ExportError is a ValueError
            self.status.set_visibility(False)
            ui.notify(f"export failed: {e}", type="negative", multi_line=True)
            return None
        finally:
            self.busy = False
        name = self._file_name(view, suffix, moment)
        self._show(f"✓ {name} ({len(data) / 1e6:.1f} MB)" if len(data) > 1e5 else f"✓ {name}", 1.0)
        self.last = (name, len(data))
        ui.download(data, name)
        return data

    def _show(self, label: str, value: float) -> None:
        """The status beside the button stays after an export: it names the file the browser got."""
        self.status_label.set_text(label)
        self.status_label.props["title"] = label
        self.progress.set_value(value)
        self.progress.set_visibility(value < 1.0)  # done: the file's name says so, in the room the bar took
        self.status.set_visibility(True)

    async def download_trace(self) -> None:
        text = await self._trace()
        if text is not None:
            name = f"kvscope-{self.run_id}.jsonl"
            self.last = (name, len(text))
            ui.download(text.encode(), name)
