"""LiveText: captions and numbers that change with every tick, without NiceGUI element updates."""

from __future__ import annotations

from nicegui import ui


class LiveText(ui.element, component="live_text.js"):
    """Text or trusted HTML set through a method call.

    NiceGUI applies an element update by re-rendering the page's whole virtual DOM; at 20 updates
    a second for a dozen captions that was the browser's largest cost under load. A method call
    reaches only this component. `content` mirrors what the browser shows (the tests read it)."""

    def __init__(self, content: str = "", *, html: bool = False) -> None:
        super().__init__()
        self.content = content
        self._props["content"] = content
        self._props["html"] = html

    @property
    def text(self) -> str:
        return self.content

    def set(self, content: str) -> None:
        if content == self.content:
            return
        self.content = content
        self._props["content"] = content  # what a reloaded page starts with; no update is sent now
        self.run_method("set", content)

    def _displayed_contents(self, *, only_visible: bool) -> list:
        return [self.content]
