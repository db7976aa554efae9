"""Which request, token and iteration the detail views of one run column look at."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.backend.events.state import RunState


@dataclass
class Selection:
    request_id: str | None = None  # None: follow a running request automatically
    seq_id: int | None = None  # one of the request's sequences (n > 1, beams); None: its default (sequence())
    token_index: int | None = None  # index into the sequence's recorded output; None: the latest
    mask_step: int | None = None  # iteration of the attention view; None: the latest
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def on_change(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def select_request(self, request_id: str | None) -> None:
        if request_id == self.request_id:
            return
        self.request_id, self.seq_id, self.token_index, self.mask_step = request_id, None, None, None
        self._notify()

    def select_sequence(self, seq_id: int | None) -> None:
        self.seq_id, self.token_index = seq_id, None
        self._notify()

    def select_token(self, index: int | None, seq_id: int | None = None) -> None:
        if seq_id is not None:
            self.seq_id = seq_id
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

    def sequence(self, state: RunState | None) -> int | None:
        """The chosen sequence of the current request, else its default (default_sequence)."""
        rid = self.current(state)
        view = state.requests.get(rid) if rid is not None else None
        if view is None:
            return None
        if self.seq_id is not None and state.seq_request.get(self.seq_id) == rid:
            return self.seq_id
        return default_sequence(state, rid)


def default_sequence(state: RunState, request_id: str) -> int | None:
    """The sequence a request shows by default: its best output once finished, else its first one still going."""
    view = state.requests[request_id]
    if view.outputs:
        return view.outputs[0]["seq_id"]
    live = [s for s in view.seq_ids if s not in state.sequences or state.sequences[s].end_step is None]
    return (live or view.seq_ids or [None])[0]
