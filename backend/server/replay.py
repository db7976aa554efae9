"""A recorded trace served like a live run: same protocol, same controls, plus seek; no model."""

from __future__ import annotations

import uuid
from collections import defaultdict

from backend.events.state import RunState
from backend.server.runs import DEFAULT_SPEED, ServedRun


class ReplayRun(ServedRun):
    kind = "replay"

    def __init__(self, events: list[dict], speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], speed, paused)
        by_step: dict[int, list[dict]] = defaultdict(list)
        for event in events:
            by_step[event["step"]].append(event)
        self.steps = sorted(by_step)  # -1 (the header) first
        self.by_step = by_step
        self.cursor = 0  # index into self.steps of the next step to publish
        self.num_steps = len(self.steps)
        self._advance()  # the header and anything before the first iteration: a replay opens ready

    def has_work(self) -> bool:
        return self.cursor < len(self.steps)

    def _advance(self) -> None:
        for event in self.by_step[self.steps[self.cursor]]:
            self.publish(event)
        self.cursor += 1
        self.finished = self.cursor >= len(self.steps)

    def _seek(self, step: int) -> None:
        """Rebuild the state as it was when iteration `step` was about to run, then resync watchers."""
        state = RunState()
        cursor = 0
        while cursor < len(self.steps) and self.steps[cursor] < step:
            for event in self.by_step[self.steps[cursor]]:
                state.apply(event)
            cursor += 1
        with self.lock:
            self.state, self.cursor = state, cursor
            self.finished = self.cursor >= len(self.steps)
        self.resync_all()

    def describe(self) -> dict:
        return {**super().describe(), "num_steps": self.num_steps}
