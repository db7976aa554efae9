"""The trace a run keeps: its header line, a window of the newest events, and the whole trace on disk.

A run that may live forever (the API's) keeps a bounded window (`Retention.trace_window`), so its
memory stays bounded whatever its age; the whole trace can stream to a file instead (trace_file.py: a
disk fault ends the file, never the run). A trace kept whole in memory (a scenario's) also gives a
late viewer the events so far (`past`), so that a page joining late draws every view from step 0.

Nothing here locks: the run calls it holding the lock under which it publishes events.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from kvscope.backend.server.trace_file import TraceFile

# A resync carries the past up to this many events (a few MB of JSON, a second or two to rebuild in
# the dashboard); a longer run resyncs from its snapshot alone, whose views start at the join.
RESYNC_PAST_LIMIT = 50_000


class RunTrace:
    """The header and the newest `window` events (None: all) as JSON lines; with `folder`, all of them on disk."""

    def __init__(self, run_id: str, window: int | None, folder: str | None) -> None:
        self.header: str | None = None  # the trace's first line, kept whatever the window
        self.lines: deque[str] = deque(maxlen=window)
        self._file = TraceFile(folder, run_id) if folder is not None else None

    def record(self, line: str, is_header: bool) -> str | None:
        """Keep the line (and write it to the file); a file fault not reported yet, for the run to publish."""
        if is_header and self.header is None:
            self.header = line
        else:
            self.lines.append(line)
        return self._file.write(line) if self._file is not None else None

    def jsonl(self) -> str:
        """The header and the newest window of events (all of them when nothing was dropped)."""
        lines = ([self.header] if self.header else []) + list(self.lines)
        return "\n".join(lines) + ("\n" if lines else "")

    def with_past(self, message: str) -> str:
        """The resync message with `past`: the whole trace so far, spliced in as the JSON it already is
        (decoding and encoding thousands of events would hold the run's lock that long). Only when
        nothing was dropped from it: a windowed trace (the API's run) resyncs from its snapshot alone."""
        complete = self.header is not None and self.lines.maxlen is None
        if not complete or len(self.lines) >= RESYNC_PAST_LIMIT:
            return message
        assert message.endswith("}")
        return message[:-1] + ',"past":[' + ",".join([self.header, *self.lines]) + "]}"

    @property
    def fault(self) -> str | None:
        """Why the trace file stopped (a full or removed disk), or None."""
        return self._file.fault if self._file is not None else None

    def flush(self) -> Path | None:
        """The whole trace's file, flushed to disk (None: no file, or it stopped: `fault` says why)."""
        return self._file.flush() if self._file is not None else None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
