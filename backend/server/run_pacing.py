"""What a run's worker obeys: its pace, pause, the steps asked for, and lesson mode's pauses.

A run steps at a watchable pace (`speed` iterations per second, 0 = unpaced) and obeys pause /
resume / step / seek. In lesson mode it pauses by itself after the iteration in which a moment its
scenario's lesson explains happened (backend/events/moments.py finds them in the events it
publishes), so the class sees that moment at any speed. A run left paused and untouched too long
expires (`Retention.paused_ttl_s`).

Nothing here locks or sleeps: the worker reads a Pacer holding its own lock, and controls change it
under the same lock, so the rules can be tested without threads. A Pacer is the run's Pacing (the one
definition of paused, speed and lesson mode, and of how a control changes them, that a dashboard
mirrors: backend/events/pacing.py) plus what the worker alone needs: the steps owed and the last touch.
"""

from __future__ import annotations

import time

from kvscope.backend.events.moments import Moment, MomentFinder, lesson_moments
from kvscope.backend.events.pacing import Pacing
from kvscope.backend.server.run_errors import RunError

DEFAULT_SPEED = 4.0  # iterations per second: slow enough to watch block by block
CONTROLS = ("pause", "resume", "step", "speed", "lesson", "seek")


class Pacer(Pacing):
    """The run's Pacing, the steps asked for while paused, and when a control last touched the run."""

    def __init__(self, speed: float = DEFAULT_SPEED, paused: bool = False, lesson: bool = False) -> None:
        super().__init__(paused=paused, speed=speed, lesson=lesson)
        self.steps_requested = 0
        self.touched = time.monotonic()  # a paused run expires paused_ttl_s after its last control

    def apply(self, action: str, value: float | int | None) -> None:
        """A control (RunError if it is not one). Seek only resets the steps owed: the run rebuilds its state."""
        check_control(action, value)
        self.touched = time.monotonic()
        if action in ("pause", "resume", "seek"):
            self.steps_requested = 0  # steps asked for before (a million, say) must not outlive them
        elif action == "step":
            self.steps_requested += int(value or 1)
        self.apply_control({"action": action, "value": value})

    def view(self) -> Pacing:
        """What the run's snapshot and the run list say of it (the fields a dashboard mirrors), as a copy."""
        return Pacing(self.paused, self.speed, self.lesson)

    def hold(self) -> None:
        """Pause as a control would (lesson mode, at a moment)."""
        self.paused, self.touched = True, time.monotonic()

    def may_step(self, has_work: bool, manual: bool = False) -> bool:
        return has_work and (manual or not self.paused or self.steps_requested > 0)

    def take_manual_step(self) -> bool:
        """Whether the next iteration is one a `step` control asked for while paused (it is used up)."""
        manual = self.paused and self.steps_requested > 0
        if manual:
            self.steps_requested -= 1
        return manual

    def next_due(self, previous: float, now: float) -> float:
        """When a paced iteration may start, one 1/speed after the previous one: late is never caught up
        with a burst."""
        return max(previous + 1.0 / self.speed, now)

    def idle_past(self, ttl_s: float | None, now: float) -> bool:
        """Paused and untouched for more than ttl_s: the run may expire."""
        return ttl_s is not None and self.paused and now - self.touched > ttl_s


def check_control(action: str, value: float | int | None) -> None:
    if action not in CONTROLS:
        raise RunError("action", f"unknown action {action!r} ({', '.join(CONTROLS)})")
    if action == "speed" and (value is None or value < 0):
        raise RunError("value", "speed must be a number of iterations per second >= 0 (0 = unpaced)")
    if action == "lesson" and value not in (0, 1):
        raise RunError("value", "lesson mode is 1 (pause at the lesson's moments) or 0 (off)")
    if action == "seek" and (value is None or value < 0):
        raise RunError("value", "seek needs a step number >= 0")


class LessonMoments:
    """Lesson mode's trigger: the first moment, in the iteration being run, of a kind the lesson explains.
    Fed on the worker thread only."""

    def __init__(self) -> None:
        self.pause_at: frozenset[str] = frozenset()  # from the header: the moments its lesson explains
        self.finder = MomentFinder()
        self.found: Moment | None = None

    def feed(self, event: dict) -> None:
        if event["type"] == "header":
            self.pause_at = lesson_moments(event.get("scenario"))
        if self.pause_at:
            found = [m for m in self.finder.feed(event) if m.kind in self.pause_at]
            self.found = self.found or (found[0] if found else None)

    def take(self) -> Moment | None:
        """The moment found since the last take, if any."""
        found, self.found = self.found, None
        return found

    def rejoin(self, finder: MomentFinder) -> None:
        """Find moments anew from a rebuilt state (a replay's seek): seeking back before one shows it again."""
        self.finder, self.found = finder, None
