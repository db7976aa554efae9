"""A recorded trace served like a live run: same protocol, same controls, plus seek; no model.

Seek is exact: a watcher's resync message carries the events replayed so far (`past`), from which
the dashboard rebuilds its record as a fresh replay stopped there would have it (a snapshot alone
tells the state, not who waited or sat preempted in the iterations before). The trace a replay
hands out is the one it was given, however often it was seeked.

The events are read, never changed: the replays of one trace share one parsed copy (replay_copies.py),
and a replay's own memory is its reducer.
"""

from __future__ import annotations

import uuid

from kvscope.backend.events.moments import MomentFinder
from kvscope.backend.events.state import RunState
from kvscope.backend.server.replay_copies import ParsedTrace
from kvscope.backend.server.run_pacing import DEFAULT_SPEED
from kvscope.backend.server.runs import Retention, ServedRun


class ReplayRun(ServedRun):
    kind = "replay"
    keeps_trace = False  # seeking publishes steps again: the trace is the one given

    def __init__(self, trace: ParsedTrace | list[dict], speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None, retention: Retention = Retention(), lesson: bool = False) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], speed, paused, retention, lesson)
        trace = trace if isinstance(trace, ParsedTrace) else ParsedTrace.of(trace)
        self.trace_copy = trace  # shared with every replay of the same trace: read, never changed
        self.events, self.steps, self.ends = trace.events, trace.steps, trace.ends
        self.cursor = 0  # index into self.steps of the next step to publish
        self.num_steps = len(self.steps)
        self._advance()  # the header and anything before the first iteration: a replay opens ready

    def has_work(self) -> bool:
        return self.cursor < len(self.steps)

    def _published(self) -> int:
        """How many of self.events the watchers have been given."""
        return self.ends[self.cursor - 1] if self.cursor else 0

    def _advance(self) -> None:
        start = self._published()
        for event in self.events[start:self.ends[self.cursor]]:
            self.publish(event)
        self.cursor += 1
        self.finished = self.cursor >= len(self.steps)

    def _seek(self, step: int) -> None:
        """Rebuild the state as it was when iteration `step` was about to run, then resync watchers."""
        cursor = next((i for i, s in enumerate(self.steps) if s >= step), len(self.steps))
        state = RunState()
        for event in self.events[:self.ends[cursor - 1]]:
            state.apply(event)
        with self.lock:
            self.state, self.cursor = state, cursor
            self.finished = self.cursor >= len(self.steps)
        # Lesson moments are firsts from here on: seeking back before one shows it again.
        self.lesson_moments.rejoin(MomentFinder.joining(state.cache.get("num_blocks"), state.step, state.seq_request))
        self.resync_all()

    def _resync_message_locked(self) -> dict:
        return {**self._snapshot_locked(), "past": self.events[:self._published()]}

    def trace_jsonl(self) -> str:
        return self.trace_copy.text

    def describe(self) -> dict:
        return {**super().describe(), "num_steps": self.num_steps}
