"""JSONL traces: TraceWriter (a bus subscriber), read_trace (validating), strip_times."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvscope.backend.errors import KvscopeError
from kvscope.backend.events.bounds import MAX_TRACE_BYTES, MAX_TRACE_EVENTS, TraceBounds, check_values
from kvscope.backend.events.bus import encode_event
from kvscope.backend.events.schema import describe_error, parse_event

log = logging.getLogger(__name__)

# Wall-clock fields: they differ between two runs of the same scenario with the same seed.
TIME_FIELDS = frozenset({"t", "duration_s", "execute_s", "ttft_s", "tpot_s", "e2e_s", "queue_s", "tokens_per_s"})


class TraceError(KvscopeError):
    """A missing or bad trace; the field is its path (a bad line: `path:line_no`)."""


class TraceWriter:
    """Writes one compact JSON line per event; use as `bus.subscribe(TraceWriter(path))`."""

    def __init__(self, path: str | Path, flush_every: int = 64):
        self.path = Path(path)
        self._file = self.path.open("w", encoding="utf-8")
        self._flush_every = flush_every
        self._unflushed = 0

    def __call__(self, event: dict[str, Any]) -> None:
        self._file.write(encode_event(event, ensure_ascii=False) + "\n")
        self._unflushed += 1
        if self._unflushed >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._unflushed = 0

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every event of a trace file, each validated; raises TraceError naming the file or the bad line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(str(path), "no such trace file")
    if path.stat().st_size > MAX_TRACE_BYTES:
        raise TraceError(str(path), f"{path.stat().st_size:,} bytes; a trace is read whole, at most "
                                    f"{MAX_TRACE_BYTES:,} bytes")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TraceError(str(path), "not a trace (not UTF-8 text)") from None
    except OSError as e:
        raise TraceError(str(path), f"cannot read ({e.strerror})") from None
    return parse_trace(text, str(path))


def parse_trace(text: str, source: str = "trace") -> list[dict[str, Any]]:
    """Every event of JSONL trace text, each validated and in step order; TraceError names `source:line`.

    Each event is checked against the bounds in bounds.py (its header's pool and lengths), so that
    whatever replays or draws the events can size itself from them.

    A last line cut short (a writer killed mid-line: no newline after it and not JSON) is dropped with
    a warning, so that the trace of a crashed run still replays up to where it stopped."""
    lines = text.splitlines()
    if len(lines) > MAX_TRACE_EVENTS:
        raise TraceError(str(source), f"{len(lines):,} lines; a trace has at most {MAX_TRACE_EVENTS:,} events")
    cut_short = not text.endswith(("\n", "\r"))
    bounds = TraceBounds()
    events: list[dict[str, Any]] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = _parse_line(line, is_first=not events)
        except ValueError as e:
            if cut_short and line_no == len(lines) and events:
                log.warning("%s:%d: the last line is cut short (%s); keeping the %d complete events before it",
                            source, line_no, e, len(events))
                break
            raise TraceError(f"{source}:{line_no}", str(e)) from None
        if events and event["step"] < events[-1]["step"]:
            raise TraceError(f"{source}:{line_no}", f"step {event['step']} comes after step {events[-1]['step']}; "
                                                    "a trace's events must be in step order")
        try:
            bounds.check(event)
        except ValueError as e:
            raise TraceError(f"{source}:{line_no}", str(e)) from None
        events.append(event)
    if not events:
        raise TraceError(str(source), "empty trace")
    return events


def _parse_line(line: str, is_first: bool) -> dict[str, Any]:
    try:
        event = json.loads(line, parse_constant=_not_a_number, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError("not JSON this reader takes (nested too deep)") from None
    if not isinstance(event, dict):
        raise ValueError(f"expected a JSON object, got {type(event).__name__}")
    check_values(event)
    try:
        parse_event(event)
    except ValidationError as e:
        raise ValueError(describe_error(e)) from None
    if is_first and event["type"] != "header":
        raise ValueError(f"the first event must be a header, not {event['type']!r}")
    return event


def _not_a_number(constant: str) -> None:
    # Python's json reads NaN and Infinity, which JSON itself does not have: a trace holding one would be
    # replayed to viewers as JSON that their parsers refuse.
    raise ValueError(f"not JSON ({constant} is not a number JSON allows)")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"not JSON this reader takes ({text} is too large for a float)")
    return value


def strip_times(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the events without wall-clock fields (and the header's run_id), for comparing runs."""
    stripped = []
    for event in events:
        drop = TIME_FIELDS | {"run_id"} if event.get("type") == "header" else TIME_FIELDS
        stripped.append({k: v for k, v in event.items() if k not in drop})
    return stripped
