"""RunRecord: a run as its readers know it, the state now (RunState) and the past (RunHistory).

One `apply(event)` feeds both, state first, because the history reads the reducer's queues at the
moment of each event. The live dashboard, the exports and the tests build it the same way, so the
picture of a run does not depend on who replays its events.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvscope.backend.events.history import RunHistory
from kvscope.backend.events.state import RunState


class RunRecord:
    def __init__(self, state: RunState | None = None, history: RunHistory | None = None) -> None:
        self.state = state if state is not None else RunState()
        self.history = history if history is not None else RunHistory()

    def apply(self, event: dict[str, Any]) -> None:
        self.state.apply(event)
        self.history.apply(event, self.state)

    @classmethod
    def from_events(cls, events: Iterable[dict[str, Any]], max_iterations: int = 256) -> RunRecord:
        """The record after these events, keeping up to max_iterations iteration events in the state."""
        record = cls(RunState(max_iterations=max_iterations))
        for event in events:
            record.apply(event)
        return record

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> RunRecord:
        """Start from a server snapshot: the whole state, and the part of the past it still tells."""
        state = RunState.from_snapshot(snapshot)
        return cls(state, RunHistory.from_snapshot(snapshot, state))
