"""Which request, token and iteration the detail views of one run column look at."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from backend.events.state import RunState


@dataclass
class Selection:
    request_id: str | None = None  # None: follow a running request automatically
    token_index: int | None = None  # index into the request's recorded tokens; None: the latest
    mask_step: int | None = None  # iteration of the attention view; None: the latest
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def on_change(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def select_request(self, request_id: str | None) -> None:
        if request_id == self.request_id:
            return
        self.request_id, self.token_index, self.mask_step = request_id, None, None
        self._notify()

    def select_token(self, index: int | None) -> None:
        self.token_index = index
        self._notify()

    def select_mask_step(self, step: int | None) -> None:
        self.mask_step = step
        self._notify()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()

    def current(self, state: RunState | None) -> str | None:
        """The chosen request, or (when following) the oldest running one, else the newest."""
        if state is None:
            return None
        if self.request_id is not None:
            return self.request_id
        if state.running:
            return state.running[0]
        return next(reversed(state.requests), None) if state.requests else None
