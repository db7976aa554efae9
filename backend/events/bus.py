"""EventBus: numbers, time-stamps and fans out events to subscribers (trace writer, websocket, ...).

Events are plain dicts and nothing is validated here: emit runs inside the step loop. `encode_event` is
the one way an event becomes JSON text (trace files, websocket frames, /trace).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

Level = Literal["full", "summary", "off"]
Subscriber = Callable[[dict[str, Any]], None]

LEVELS: tuple[str, ...] = ("full", "summary", "off")
# High-volume detail that a summary trace can live without. Block events are never dropped:
# the reducer needs every one of them to rebuild block tables and the free list.
SUMMARY_DROPPED = frozenset({"attention_mask", "spec_propose"})
SUMMARY_STRIPPED = {"token": "dist"}
OFF_KEPT = frozenset(
    {"header", "request_arrived", "request_finished", "run_finished", "metrics", "request_rejected", "error"}
)


class EventBus:
    """emit(type, **fields) -> the event dict (None when the level drops it)."""

    def __init__(self, level: Level = "full", clock: Callable[[], float] = time.perf_counter):
        self.level = level
        self.step = -1
        self._clock = clock
        self._start = clock()
        self._seq = 0
        # Replaced, never mutated, so that a subscribe from another thread cannot break an emit.
        self._subscribers: tuple[Subscriber, ...] = ()
        self._subscribers_lock = threading.Lock()

    @property
    def level(self) -> Level:
        return self._level

    @level.setter
    def level(self, value: Level) -> None:
        if value not in LEVELS:
            raise ValueError(f"events level must be one of {', '.join(LEVELS)}, not {value!r}")
        self._level = value

    @property
    def wants_dist(self) -> bool:
        """Whether token events keep their `dist` (so the sampler may skip building it)."""
        return self._level == "full"

    def wants(self, type: str) -> bool:
        """Whether an event of this type would be emitted at the current level."""
        if self._level == "full":
            return True
        if self._level == "summary":
            return type not in SUMMARY_DROPPED
        return type in OFF_KEPT

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Time events by another clock from now on, from 0 (simulate mode: modelled seconds)."""
        self._clock, self._start = clock, clock()

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call fn(event) for every emitted event; returns a function that unsubscribes it."""
        with self._subscribers_lock:
            self._subscribers = (*self._subscribers, fn)

        def unsubscribe() -> None:
            with self._subscribers_lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not fn)

        return unsubscribe

    def emit(self, type: str, **fields: Any) -> dict[str, Any] | None:
        if not self.wants(type):
            return None
        if self._level == "summary" and type in SUMMARY_STRIPPED:
            fields.pop(SUMMARY_STRIPPED[type], None)
        event = {"type": type, "seq": self._seq, "step": self.step, "t": self._clock() - self._start}
        event.update(fields)
        self._seq += 1
        for fn in self._subscribers:
            fn(event)
        return event


def encode_event(event: dict[str, Any], ensure_ascii: bool = True) -> str:
    """One event as compact JSON text. A NaN or an infinity is a ValueError naming the event and the
    field: Python's json would write a bare `NaN`, which no JSON parser (the browser's included) reads.
    Inputs are bounded so that none arises; this is where one would be caught."""
    try:
        return json.dumps(event, separators=(",", ":"), ensure_ascii=ensure_ascii, allow_nan=False)
    except ValueError:
        field = next(_non_finite(event), "a value")
        raise ValueError(f"{event.get('type', 'an')} event: {field} is not a finite number") from None


def _non_finite(value: Any, path: str = ""):
    """Dotted paths of the NaN and infinite floats inside value."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path or "the value"
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{path}[{i}]")
