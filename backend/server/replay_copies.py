"""Parsed traces, shared by the replays that show them and counted in bytes.

Opening a saved run parsed its trace again every time: a 115 MB trace took ~760 MB more at each open (six
opens: 1.2 -> 5.8 GB). A replay only reads its trace's events (its reducer, the one thing it changes, is
its own), so the replays of one trace (a library entry, or the same text sent twice) share one parsed
copy: the events in step order, where each step ends, and the text handed back as the replay's trace.
The copy lives while a replay holds it; the last one to go lets it go.

Bytes are estimated from the trace's length before a byte of it is read, so that a refusal costs
nothing: a parsed event takes ~6.3 times its JSON text as Python objects and the text handed back once
more (a demo trace: 1.47 MB of JSON, 9.3 MB parsed, 1.5 MB written back); each replay's own reducer adds
~8% of the text by its end, counted once per replay.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

COPY_PER_TEXT_BYTE = 7.5  # the parsed events and the text handed back, per byte of the trace's JSON
STATE_PER_TEXT_BYTE = 0.1  # one replay's reducer at the end of the trace, per byte of its JSON


@dataclass(frozen=True)
class ParsedTrace:
    """A trace as its replays read it: never changed once built."""

    events: list[dict[str, Any]]  # in step order (stable: the trace's own order within a step)
    steps: list[int]  # the distinct steps, -1 (the header) first
    ends: list[int]  # events up to and including steps[i]
    text: str  # the JSONL a replay hands back as its trace

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> ParsedTrace:
        ordered = sorted(events, key=lambda e: e["step"])
        steps = sorted({e["step"] for e in ordered})
        index = {s: i for i, s in enumerate(steps)}
        counts = [0] * len(steps)
        for e in ordered:
            counts[index[e["step"]]] += 1
        text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)
        return cls(ordered, steps, list(accumulate(counts)), text)


def copy_bytes(text_bytes: int) -> int:
    return int(text_bytes * COPY_PER_TEXT_BYTE)


def state_bytes(text_bytes: int) -> int:
    return int(text_bytes * STATE_PER_TEXT_BYTE)


class ReplayCopies:
    """The parsed copies, by key, and the replays holding each. Thread-safe: runs start on request threads."""

    def __init__(self) -> None:
        self._sizes: dict[Hashable, int] = {}  # key -> its trace's text bytes (held, parsed or not yet)
        self._copies: dict[Hashable, ParsedTrace] = {}
        self._holders: dict[Hashable, set[str]] = {}
        self._held_by: dict[str, Hashable] = {}
        self._lock = threading.Lock()
        self._parsing = threading.Lock()  # one parse at a time: two opens of one trace parse it once

    def new_bytes(self, key: Hashable, text_bytes: int) -> int:
        """What one more replay of this trace would add: its reducer, and the copy unless one is held."""
        with self._lock:
            shared = key in self._sizes
        return state_bytes(text_bytes) + (0 if shared else copy_bytes(text_bytes))

    def held_bytes(self) -> int:
        with self._lock:
            return sum(copy_bytes(size) + state_bytes(size) * len(self._holders[key])
                       for key, size in self._sizes.items())

    def hold(self, run_id: str, key: Hashable, text_bytes: int) -> None:
        """Count the replay `run_id` as holding the copy of `key` (its bytes count before it is parsed)."""
        with self._lock:
            self._sizes.setdefault(key, text_bytes)
            self._holders.setdefault(key, set()).add(run_id)
            self._held_by[run_id] = key

    def release(self, run_id: str) -> None:
        """The replay is gone; a copy nobody holds any more is let go."""
        with self._lock:
            key = self._held_by.pop(run_id, None)
            if key is None:
                return
            holders = self._holders[key]
            holders.discard(run_id)
            if not holders:
                del self._holders[key], self._sizes[key]
                self._copies.pop(key, None)

    def copy(self, key: Hashable, events: Callable[[], list[dict[str, Any]]]) -> ParsedTrace:
        """The shared copy of `key` (held: see hold), parsed from events() if no replay has it yet."""
        with self._parsing:
            with self._lock:
                found = self._copies.get(key)
            if found is not None:
                return found
            parsed = ParsedTrace.of(events())
            with self._lock:
                if key in self._holders:  # not released meanwhile
                    self._copies[key] = parsed
            return parsed

    def describe(self) -> list[dict[str, Any]]:
        """Each copy for GET /api/limits: where it came from (a key's first item), its trace's bytes, its bytes
        with its replays' reducers, how many replays hold it, whether it is parsed yet."""
        with self._lock:
            return [{"source": str(key[0]) if isinstance(key, tuple) else "trace", "trace_bytes": size,
                     "bytes": copy_bytes(size) + state_bytes(size) * len(self._holders[key]),
                     "runs": len(self._holders[key]), "parsed": key in self._copies}
                    for key, size in self._sizes.items()]
