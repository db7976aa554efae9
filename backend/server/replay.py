"""A recorded trace served like a live run: same protocol, same controls, plus seek; no model.

Seek is exact: a watcher's resync message carries the events replayed so far (`past`), from which
the dashboard rebuilds its record as a fresh replay stopped there would have it (a snapshot alone
tells the state, not who waited or sat preempted in the iterations before). The trace a replay
hands out is the one it was given, however often it was seeked.
"""

from __future__ import annotations

import json
import uuid
from itertools import accumulate

from kvscope.backend.events.moments import MomentFinder
from kvscope.backend.events.state import RunState
from kvscope.backend.server.run_pacing import DEFAULT_SPEED
from kvscope.backend.server.runs import Retention, ServedRun


class ReplayRun(ServedRun):
    kind = "replay"
    keeps_trace = False  # seeking publishes steps again: the trace is the one given

    def __init__(self, events: list[dict], speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None, retention: Retention = Retention(), lesson: bool = False) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], speed, paused, retention, lesson)
        self.events = sorted(events, key=lambda e: e["step"])  # stable: the trace's order within a step
        self.steps = sorted({e["step"] for e in self.events})  # -1 (the header) first
        self.ends = list(accumulate(_counts(self.events, self.steps)))  # events up to and including steps[i]
        self.original = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)
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
        return self.original

    def describe(self) -> dict:
        return {**super().describe(), "num_steps": self.num_steps}


def _counts(events: list[dict], steps: list[int]) -> list[int]:
    """Events per step, in the order of `steps` (events sorted by step)."""
    index = {s: i for i, s in enumerate(steps)}
    counts = [0] * len(steps)
    for e in events:
        counts[index[e["step"]]] += 1
    return counts
