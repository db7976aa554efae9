"""The landing page's run library: runs saved by the server (GET /api/library), to open, rename or delete.

A lecturer runs the scenarios before class; each finished run is saved with its scenario and settings,
and opens again as a replay, paused at its start, whose every view is the live run's. A compare page's
two runs are saved as a pair (`SavePair`, on that page) and open again side by side. Each element
carries its marker twice: `.mark` for the simulated user, `data-kv` for Chromium.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nicegui import ui

from kvscope.frontend.client import Backend, BackendError


def saved_when(entry: dict[str, Any]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["created"]))


def size_text(num_bytes: int) -> str:
    mb = num_bytes / 1024**2
    return f"{num_bytes / 1024:.0f} KB" if mb < 1 else f"{mb:.1f} MB" if mb < 10 else f"{mb:.0f} MB"


def saved_facts(entry: dict[str, Any]) -> str:
    """One line under a saved run's name: its scenario (once renamed), date, steps, requests, what was changed."""
    parts = [f"scenario {entry['scenario']}"] if entry["name"] != entry["scenario"] else []
    parts += [saved_when(entry), f"{entry['steps']} steps", f"{entry['requests']} requests"]
    if entry["overrides"]:
        parts.append(", ".join(f"{k.removeprefix('engine.')}={v}" for k, v in entry["overrides"].items()))
    return " · ".join(parts)


class SavedRuns:
    """A card listing the library; `navigate(run_id, compare)` opens the replay a saved run became, or a
    pair's two side by side."""

    def __init__(self, backend: Backend, navigate: Callable[[str, str | None], None]) -> None:
        self.backend = backend
        self.navigate = navigate
        self.entries: list[dict[str, Any]] = []
        self.pairs: list[dict[str, Any]] = []
        with ui.card().classes("kv-card w-full").props("flat bordered").mark("library").props("data-kv=library"):
            ui.label("Run library").classes("kv-card-title")
            self.body = ui.column().classes("w-full gap-1")

    async def load(self) -> None:
        try:
            listing = await self.backend.library()
        except BackendError as e:
            self._show_note(f"The run library could not be read: {e}")
            return
        self.entries, self.pairs = listing["entries"], listing.get("pairs", [])
        if not listing["enabled"]:
            self._show_note("This server keeps no library (started with --no-library): runs live in its memory.")
        elif not self.entries:
            self._show_note("No saved runs yet: every run that finishes is saved here, to open again later.")
        else:
            self._show_entries(listing)

    def _show_note(self, text: str) -> None:
        self.body.clear()
        with self.body:
            ui.label(text).classes("kv-muted").mark("library-empty").props("data-kv=library-empty")

    def _show_entries(self, listing: dict[str, Any]) -> None:
        self.body.clear()
        with self.body:
            used = f"{size_text(listing['bytes'])} of {size_text(listing['max_bytes'])}"
            ui.label(f"Finished runs, saved on the server ({used}; the oldest go first). "
                     "Each opens paused at its start.").classes("kv-muted")
            by_id = {e["id"]: e for e in self.entries}
            for pair in self.pairs:
                self._pair_row(pair, [by_id[run_id] for run_id in pair["runs"]])
            for entry in self.entries:
                self._entry_row(entry)

    def _pair_row(self, pair: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        with ui.row().classes("items-center gap-2 no-wrap w-full").mark("library-pair").props("data-kv=library-pair"):
            ui.button(icon="compare", on_click=lambda p=pair: self.open_pair(p, runs)).props("flat round dense") \
                .mark("library-pair-open").props("data-kv=library-pair-open") \
                .tooltip("open both side by side, paused at their start")
            with ui.column().classes("gap-0"):
                ui.label(pair["name"]).classes("kv-run-link").mark("library-pair-name") \
                    .props("data-kv=library-pair-name")
                ui.label(f"compare pair · {runs[0]['name']} | {runs[1]['name']} · saved {saved_when(pair)}") \
                    .classes("kv-muted")
            ui.space()
            ui.button(icon="delete", on_click=lambda p=pair: self._delete_pair(p)).props("flat round dense") \
                .mark("library-pair-delete").props("data-kv=library-pair-delete") \
                .tooltip("forget the pair (its two runs stay in the library)")

    def _entry_row(self, entry: dict[str, Any]) -> None:
        with ui.row().classes("items-center gap-2 no-wrap w-full").mark("library-entry").props("data-kv=library-entry"):
            ui.button(icon="play_arrow", on_click=lambda e=entry: self.open(e)).props("flat round dense") \
                .mark("library-open").props("data-kv=library-open").tooltip("open as a replay, paused at its start")
            with ui.column().classes("gap-0"):
                with ui.row().classes("items-baseline gap-2 no-wrap"):
                    ui.label(entry["name"]).classes("kv-run-link").mark("library-name").props("data-kv=library-name")
                    if entry["failed"]:
                        ui.badge("failed", color="negative").tooltip(entry.get("failure") or "")
                ui.label(saved_facts(entry)).classes("kv-muted").mark("library-facts").props("data-kv=library-facts")
            ui.space()
            ui.button(icon="edit", on_click=lambda e=entry: self._ask_name(e)).props("flat round dense") \
                .mark("library-rename").props("data-kv=library-rename").tooltip("rename")
            ui.button(icon="delete", on_click=lambda e=entry: self._ask_delete(e)).props("flat round dense") \
                .mark("library-delete").props("data-kv=library-delete").tooltip("delete from the library")

    async def open(self, entry: dict[str, Any]) -> None:
        try:
            run_id = await self.backend.open_saved(entry["id"], paused=True, lesson=entry["lesson"])
        except BackendError as e:
            ui.notify(f"Could not open {entry['name']}: {e}", type="negative", multi_line=True)
            return
        self.navigate(run_id)

    async def open_pair(self, pair: dict[str, Any], runs: list[dict[str, Any]]) -> None:
        try:
            left, right = await self.backend.open_pair(pair["id"], paused=True, lesson=any(r["lesson"] for r in runs))
        except BackendError as e:
            ui.notify(f"Could not open {pair['name']}: {e}", type="negative", multi_line=True)
            return
        self.navigate(left, right)

    async def _delete_pair(self, pair: dict[str, Any]) -> None:
        try:
            await self.backend.delete_pair(pair["id"])
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        await self.load()

    def _ask_name(self, entry: dict[str, Any]) -> None:
        with ui.dialog() as dialog, ui.card().classes("kv-card"):
            ui.label("Rename the saved run").classes("kv-card-title")
            name = ui.input("name", value=entry["name"]).props("autofocus").style("width: 22rem").mark("library-name-input").props("data-kv=library-name-input")
            with ui.row().classes("gap-2"):
                ui.button("Save", on_click=lambda: self._rename(dialog, entry, name.value)).mark("library-rename-save").props("data-kv=library-rename-save")
                ui.button("Cancel", on_click=dialog.close).props("flat")
        dialog.open()

    async def _rename(self, dialog: ui.dialog, entry: dict[str, Any], name: str) -> None:
        try:
            await self.backend.rename_saved(entry["id"], name)
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        dialog.close()
        await self.load()

    def _ask_delete(self, entry: dict[str, Any]) -> None:
        with ui.dialog() as dialog, ui.card().classes("kv-card"):
            ui.label(f"Delete “{entry['name']}” from the library?").classes("kv-card-title")
            with ui.row().classes("gap-2"):
                ui.button("Delete", color="negative", on_click=lambda: self._delete(dialog, entry)) \
                    .mark("library-delete-confirm").props("data-kv=library-delete-confirm")
                ui.button("Cancel", on_click=dialog.close).props("flat")
        dialog.open()

    async def _delete(self, dialog: ui.dialog, entry: dict[str, Any]) -> None:
        try:
            await self.backend.delete_saved(entry["id"])
        except BackendError as e:
            ui.notify(str(e), type="negative")
            return
        dialog.close()
        await self.load()


class SavePair:
    """The compare page's button that keeps its two runs in the library as a pair (once both have finished:
    a run is saved when it finishes)."""

    def __init__(self, backend: Backend, run_ids: tuple[str, str]) -> None:
        self.backend, self.run_ids = backend, run_ids
        with ui.row().classes("w-full justify-end").style("grid-column: 1 / -1"):  # across the compare grid
            self.button = ui.button("Save pair to library", icon="bookmark_add", on_click=self.save) \
                .props("flat dense no-caps size=sm").mark("save-pair").props("data-kv=save-pair") \
                .tooltip("keep these two runs together in the run library, to open side by side later")

    async def save(self) -> dict[str, Any] | None:
        try:
            pair = await self.backend.save_pair(self.run_ids)
        except BackendError as e:
            ui.notify(f"Could not save the pair: {e}", type="warning", multi_line=True)
            return None
        ui.notify(f"Saved to the run library as “{pair['name']}”", type="positive")
        return pair
