"""The export menu: PNG / SVG of a view, a GIF of the run and a Perfetto trace (rendered server-side by the
`frontend.export` package from the run's trace), and the trace itself as JSONL."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from nicegui import run, ui

from kvscope.frontend.client import Backend, BackendError

VIEWS = {"timeline": "Timeline", "blocks": "Block pool", "batch": "Batch composition"}


def parse_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def render_bytes(events: list[dict], view: str, suffix: str) -> bytes:
    """The picture (or Perfetto JSON) of one view as bytes, through a temporary file."""
    from kvscope.frontend.export import render  # matplotlib loads on the first export only

    with tempfile.TemporaryDirectory(prefix="kvscope-export-") as folder:
        out = Path(folder) / f"{view}{suffix}"
        render(events, view, out)
        return out.read_bytes()


class ExportMenu:
    def __init__(self, backend: Backend, run_id: str) -> None:
        self.backend = backend
        self.run_id = run_id
        self.last: tuple[str, int] | None = None  # (filename, size) of the last export, for tests
        button = ui.button(icon="download").props("flat round color=white data-kv=export").tooltip("export")
        with button.mark("export"):
            with ui.menu().mark("export-menu"):
                for view, title in VIEWS.items():
                    for suffix in (".png", ".svg"):
                        ui.menu_item(f"{title} {suffix[1:].upper()}",
                                     lambda v=view, s=suffix: self.export(v, s)).mark(f"export-{view}{suffix}")
                ui.menu_item("Timeline as Perfetto JSON", lambda: self.export("timeline", ".json")) \
                    .mark("export-perfetto")
                ui.menu_item("Run as GIF (block pool + timeline)", lambda: self.export("blocks", ".gif")) \
                    .mark("export-gif")
                ui.menu_item("Trace JSONL", self.download_trace).mark("export-trace")

    async def _trace(self) -> str | None:
        try:
            return await self.backend.trace(self.run_id)
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return None

    async def export(self, view: str, suffix: str) -> bytes | None:
        text = await self._trace()
        if text is None:
            return None
        ui.notify(f"rendering {VIEWS[view].lower()} {suffix[1:].upper()} ...")
        try:
            data = await run.io_bound(render_bytes, parse_jsonl(text), view, suffix)
        except (ValueError, ImportError) as e:  # ExportError is a ValueError
            ui.notify(f"export failed: {e}", type="negative", multi_line=True)
            return None
        name = f"kvscope-{self.run_id}-{ {'.json': 'perfetto', '.gif': 'run'}.get(suffix, view)}{suffix}"
        self.last = (name, len(data))
        ui.download(data, name)
        return data

    async def download_trace(self) -> None:
        text = await self._trace()
        if text is not None:
            name = f"kvscope-{self.run_id}.jsonl"
            self.last = (name, len(text))
            ui.download(text.encode(), name)
