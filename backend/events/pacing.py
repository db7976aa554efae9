"""Pacing: how a served run goes (paused or not, how fast, in lesson mode or not), not what it computes.

It is the run's and its viewers', not the engine's: the server's run owns it (a Pacer,
server/run_pacing.py, adds what its worker needs) and says it in each snapshot and in the run list
under these names, and records each change as a `control` event so that a replay shows when the
class paused. The reducer (state.py) ignores those events; a
dashboard mirrors the run's pacing from its snapshot and the `control` events after it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class Pacing:
    paused: bool = False
    speed: float | None = None  # iterations per second, 0 = unpaced; None until a snapshot says
    lesson: bool = False  # lesson mode: the run pauses at the moments its lesson explains

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> Pacing:
        """The pacing a snapshot tells; a field it lacks (a bare reducer's snapshot) keeps its default."""
        return cls(**{f.name: snapshot[f.name] for f in fields(cls) if f.name in snapshot})

    def apply_control(self, event: dict[str, Any]) -> None:
        """A `control` event of the run, as the run obeys it (a step pauses it): the server's run applies
        each control through here (server/run_pacing.py), a dashboard each control event it receives."""
        action, value = event["action"], event.get("value")
        if action in ("pause", "resume", "step"):
            self.paused = action != "resume"
        elif action == "speed":
            self.speed = None if value is None else float(value)
        elif action == "lesson":
            self.lesson = bool(value)
