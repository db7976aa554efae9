"""A served run's whole trace on disk (`--trace-dir`): it never overwrites a file, and a disk fault
stops the file, never the run.

The file is `<dir>/<run_id>.jsonl`, or the first free `<dir>/<run_id>-N.jsonl` when an earlier run
(before a restart, say) left one there: created exclusively, so no earlier trace is ever truncated.
A full disk (ENOSPC), a removed folder or any other OSError ends the file for good: `fault` then says
why in words a client may read (the error's strerror, never the path, which stays in the server's
log), the run reports it once as a non-fatal `error` event, and `/trace` refuses to serve the file.
A removed folder raises nothing on Linux (writes go on to the unlinked inode), so the file checks,
at most once a second, that it still has a name.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TextIO

log = logging.getLogger(__name__)

MAX_ROTATIONS = 10_000  # <run_id>-1 ... -N tried before giving up: a bound on the names looked at
CHECK_EVERY_S = 1.0  # how often writing also flushes and checks that the file still has a name


class TraceFile:
    """Lines appended to a new file under `folder`; every method is a no-op once `fault` is set."""

    def __init__(self, folder: str | Path, run_id: str) -> None:
        self.path: Path | None = None
        self.fault: str | None = None  # why the file stopped, for clients (no path)
        self._unreported: str | None = None  # a fault the run has not told its watchers yet
        self._file: TextIO | None = None
        self._checked = time.monotonic()
        try:
            self.path, self._file = _create(Path(folder), run_id)
        except OSError as e:
            self._stop(e, f"{Path(folder) / run_id}.jsonl")

    def write(self, line: str) -> str | None:
        """Append one line; returns a fault not reported yet (once), for the run to emit as an event."""
        if self._file is not None:
            try:
                self._file.write(line + "\n")
                if time.monotonic() - self._checked > CHECK_EVERY_S:
                    self._check()
            except OSError as e:
                self._stop(e)
        return self.take_unreported()

    def take_unreported(self) -> str | None:
        fault, self._unreported = self._unreported, None
        return fault

    def flush(self) -> Path | None:
        """The file, flushed to disk; None once it has stopped (then `fault` says why)."""
        if self._file is not None:
            try:
                self._check()
            except OSError as e:
                self._stop(e)
        return self.path if self.fault is None else None

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:  # the last buffered lines did not fit: the file is short, the run is over
                log.error("trace file %s: %s", self.path, e)
            self._file = None

    def _check(self) -> None:
        self._file.flush()
        self._checked = time.monotonic()
        if os.fstat(self._file.fileno()).st_nlink == 0:  # its folder (or the file) was removed
            raise FileNotFoundError(0, "the trace folder was removed")

    def _stop(self, error: OSError, where: Path | str | None = None) -> None:
        log.error("trace file %s stopped: %s", where or self.path, error)
        self.fault = self._unreported = error.strerror or type(error).__name__
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # buffered lines that cannot be written either: the fault is already known
            self._file = None


def _create(folder: Path, run_id: str) -> tuple[Path, TextIO]:
    """The first of <run_id>.jsonl, <run_id>-1.jsonl, ... that does not exist, created and opened."""
    for n in range(MAX_ROTATIONS):
        path = folder / (f"{run_id}.jsonl" if n == 0 else f"{run_id}-{n}.jsonl")
        try:
            return path, path.open("x", encoding="utf-8")
        except FileExistsError:
            continue
    raise FileExistsError(0, f"{MAX_ROTATIONS} earlier traces of this run id are in the folder")
