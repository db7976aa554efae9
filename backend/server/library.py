"""The run library: finished runs kept on disk, so that a class can be prepared ahead and a restart loses nothing.

A folder holds, per entry, the run's whole trace (`<id>.jsonl`, written by trace_file.py, which never
overwrites a file) and a small JSON sidecar (`<id>.json`: name, scenario, overrides, model, when,
steps, requests, bytes). The sidecar is written last and atomically: a trace without one is a save
that did not finish, and is not an entry. The folder is bounded (`max_bytes`): a save evicts the
oldest entries until the rest fit.

A compare pair (two saved runs side by side, as the compare page showed them) is a sidecar of its own
in `pairs/<id>.json` naming its two entries; it goes when either entry goes (deleted or evicted), and
at most MAX_PAIRS are kept (the oldest go).

Anything in the folder may have been edited, truncated or planted. An id is a file stem of a fixed
alphabet (no path ever comes from a client or a sidecar), a sidecar is read only if small and valid,
and a trace whose size is not the one its sidecar recorded is skipped: each with one logged line,
never an error for the client who lists the library.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import unicodedata
import uuid
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvscope.backend.errors import KvscopeError
from kvscope.backend.events.compare import setting_differences
from kvscope.backend.events.record import RunRecord
from kvscope.backend.server.trace_file import TraceFile

log = logging.getLogger(__name__)
Item = TypeVar("Item", bound="_Named")

ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")  # a run id: a file stem, never a path
TRACE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,63}\.jsonl$"  # trace_file.py's <run_id>.jsonl or <run_id>-N.jsonl
MAX_SIDECAR_BYTES = 64 * 1024  # a sidecar is a few hundred bytes: a larger one is not ours
MAX_NAME = 120
MAX_HEADER_BYTES = 2**20  # a trace's header line (the scenario, the config, the model) is a few KB
MAX_PAIRS = 256  # a pair's sidecar is a few hundred bytes: the folder of them stays under 100 KB
DEFAULT_MAX_MB = 2048.0


class LibraryError(KvscopeError):
    """A library request that cannot be done: a bad id or name (400), or an entry that is gone (404)."""

    def __init__(self, field: str | None, reason: str, missing: bool = False) -> None:
        super().__init__(field, reason)
        self.missing = missing


class _Named(BaseModel):
    """A library item's sidecar: an id and a name a page shows."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(pattern=ID_PATTERN.pattern)
    name: str = Field(min_length=1, max_length=MAX_NAME)

    @field_validator("name")
    @classmethod
    def _fit(cls, name: str) -> str:
        """A sidecar edited on disk is held to the rename's rule: it is skipped, never listed."""
        if not fit_name(name):
            raise ValueError(NAME_RULE)
        return name


class Entry(_Named):
    """One saved run, as its sidecar stores it and GET /api/library lists it."""

    scenario: str = Field(max_length=200)
    model: str = Field(max_length=1000)
    overrides: dict[str, Any] = Field(default_factory=dict)
    lesson: bool = False
    created: float = Field(ge=0)  # seconds since the epoch
    steps: int = Field(ge=0)
    requests: int = Field(ge=0)
    failed: bool = False
    failure: str | None = Field(default=None, max_length=1000)
    trace: str = Field(pattern=TRACE_PATTERN)  # the trace's file name, in the library folder
    trace_bytes: int = Field(ge=0)


EntryId = Annotated[str, Field(pattern=f"^{ID_PATTERN.pattern}$")]  # anchored: a pair names its runs by file stem


class Pair(_Named):
    """Two saved runs compared side by side, as its sidecar stores it and GET /api/library lists it."""

    runs: tuple[EntryId, EntryId]  # the left and the right column's entries
    created: float = Field(ge=0)  # seconds since the epoch


def default_folder() -> Path:
    """$XDG_DATA_HOME/kvscope/library, or ~/.local/share/kvscope/library (runs are data, not a cache)."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "kvscope" / "library"


def check_id(entry_id: str) -> str:
    if not ID_PATTERN.fullmatch(entry_id):
        raise LibraryError("id", f"{entry_id[:64]!r} is not a library id (lower-case letters, digits and -)")
    return entry_id


# Unicode's control (Cc: C0, DEL, C1), format (Cf: the bidi overrides such as U+202E that reorder what a
# name shows, zero-width characters), surrogate, private-use and unassigned characters, and the line and
# paragraph separators: none belongs in a one-line name a page shows.
REFUSED_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
MARKUP = set("<>")  # a name is text: a page that forgot to escape one must not find a tag in it
NAME_RULE = (f"a name has 1 to {MAX_NAME} characters, no control or formatting characters (such as U+202E, "
             "which reverses the text after it) and no < or >")


def fit_name(name: str) -> bool:
    return 1 <= len(name) <= MAX_NAME and not any(unicodedata.category(c) in REFUSED_CATEGORIES or c in MARKUP
                                                  for c in name)


def check_name(name: str) -> str:
    name = name.strip()
    if not fit_name(name):
        raise LibraryError("name", NAME_RULE)
    return name


class RunLibrary:
    """The folder's entries: save, list, rename, delete, read a trace. Thread-safe (runs finish on their threads)."""

    def __init__(self, folder: str | Path, max_mb: float = DEFAULT_MAX_MB) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pairs_folder = self.folder / "pairs"  # made by the first pair saved
        self.max_bytes = int(max_mb * 1024**2)
        self._lock = threading.Lock()

    def entries(self) -> list[Entry]:
        """Every valid entry, newest first; anything else in the folder is skipped with a logged line."""
        found = (self._read(path) for path in self.folder.glob("*.json"))
        return sorted((e for e in found if e is not None), key=lambda e: e.created, reverse=True)

    def get(self, entry_id: str) -> Entry:
        entry = self._read(self.folder / f"{check_id(entry_id)}.json")
        if entry is None:
            raise LibraryError("id", f"no library entry {entry_id!r}", missing=True)
        return entry

    def trace_text(self, entry_id: str) -> str:
        """The entry's trace as saved (the caller parses it, naming the entry in any error)."""
        entry = self.get(entry_id)
        try:
            return (self.folder / entry.trace).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            log.warning("library: %s: cannot read %s: %s", entry_id, entry.trace, e)
            raise LibraryError("id", f"library entry {entry_id!r}: its trace cannot be read", missing=True) from None

    def save(self, trace: str, **facts: Any) -> Entry | None:
        """Store a run's trace and its facts (Entry's fields but trace, trace_bytes and created) under
        facts["id"], replacing an entry of that id; then evict the oldest to fit. None if it cannot."""
        data = trace.encode("utf-8")
        if len(data) > self.max_bytes:
            log.warning("library: run %s not saved: %d bytes is more than --library-max-mb", facts["id"], len(data))
            return None
        with self._lock:
            self._remove_locked(check_id(facts["id"]))
            file = TraceFile(self.folder, facts["id"])
            file.write(trace.removesuffix("\n"))
            file.close()
            if file.fault is not None or file.path is None:
                log.warning("library: run %s not saved: %s", facts["id"], file.fault)
                return None
            entry = Entry(**facts, created=time.time(), trace=file.path.name, trace_bytes=file.path.stat().st_size)
            self._write_sidecar(entry)
            self._evict_locked(keep=entry.id)
        return entry

    def rename(self, entry_id: str, name: str) -> Entry:
        with self._lock:
            entry = self.get(entry_id).model_copy(update={"name": check_name(name)})
            self._write_sidecar(entry)
        return entry

    def delete(self, entry_id: str) -> None:
        with self._lock:
            self.get(entry_id)  # a 404 for an id that is not an entry
            self._remove_locked(entry_id)
            self._drop_pairs_locked(entry_id)

    # ---- compare pairs ------------------------------------------------------------------------------

    def pairs(self) -> list[Pair]:
        """Every valid pair whose two entries are listed, newest first."""
        listed = {e.id for e in self.entries()}
        found = (self._read_sidecar(path, Pair) for path in self.pairs_folder.glob("*.json"))
        return sorted((p for p in found if p is not None and set(p.runs) <= listed), key=lambda p: p.created,
                      reverse=True)

    def get_pair(self, pair_id: str) -> Pair:
        pair = self._read_sidecar(self.pairs_folder / f"{check_id(pair_id)}.json", Pair)
        if pair is None:
            raise LibraryError("id", f"no compare pair {pair_id!r} in the library", missing=True)
        return pair

    def save_pair(self, runs: tuple[str, str], name: str | None = None) -> Pair:
        """Keep two entries as a pair (LibraryError naming `runs` if either is not one); the oldest pairs go
        beyond MAX_PAIRS."""
        a, b = (self._entry_for_pair(run_id) for run_id in runs)
        name = check_name(name) if name else pair_name(a, b, self._differences(a, b))
        pair = Pair(id=uuid.uuid4().hex[:12], name=name, runs=(a.id, b.id), created=time.time())
        with self._lock:
            self.pairs_folder.mkdir(exist_ok=True)
            self._write_sidecar(pair, self.pairs_folder)
            for old in self._pairs_locked()[MAX_PAIRS:]:
                (self.pairs_folder / f"{old.id}.json").unlink(missing_ok=True)
        return pair

    def delete_pair(self, pair_id: str) -> None:
        with self._lock:
            self.get_pair(pair_id)
            (self.pairs_folder / f"{pair_id}.json").unlink(missing_ok=True)

    def _entry_for_pair(self, run_id: str) -> Entry:
        try:
            return self.get(run_id)
        except LibraryError:
            raise LibraryError("runs", f"{run_id[:64]!r} is not a saved run (a run is saved when it finishes: "
                                       "save the pair once both have)") from None

    def _differences(self, a: Entry, b: Entry) -> list[tuple[str, Any, Any]]:
        """The settings the two runs' headers disagree on (what the compare page titles its columns by)."""
        try:
            records = [RunRecord.from_events([self._header(e)]) for e in (a, b)]
        except (KeyError, TypeError, ValueError) as e:  # a header cut or edited on disk: the runs' names will do
            log.warning("library: pair of %s and %s: a header the reducer cannot read: %r", a.id, b.id, e)
            return []
        return setting_differences(*records)

    def _header(self, entry: Entry) -> dict[str, Any]:
        """The first line of the entry's trace (read at most MAX_HEADER_BYTES); ValueError if it is no header."""
        try:
            with (self.folder / entry.trace).open("rb") as f:
                header = json.loads(f.readline(MAX_HEADER_BYTES))
        except OSError as e:
            raise ValueError(f"library entry {entry.id}: its trace cannot be read: {e}") from None
        if not isinstance(header, dict) or header.get("type") != "header":
            raise ValueError(f"library entry {entry.id}: its trace does not start with a header")
        return header

    def _pairs_locked(self) -> list[Pair]:
        """Every readable pair, newest first, listed or not."""
        found = (self._read_sidecar(path, Pair) for path in self.pairs_folder.glob("*.json"))
        return sorted((p for p in found if p is not None), key=lambda p: p.created, reverse=True)

    def _drop_pairs_locked(self, entry_id: str) -> None:
        """A pair shows both its runs or nothing: it goes with either."""
        for pair in self._pairs_locked():
            if entry_id in pair.runs:
                log.info("library: pair %s (%s) removed with its run %s", pair.id, pair.name, entry_id)
                (self.pairs_folder / f"{pair.id}.json").unlink(missing_ok=True)

    # ---- the folder ---------------------------------------------------------------------------------

    def _read(self, sidecar: Path) -> Entry | None:
        """The sidecar's entry if it is ours and its trace is whole; None (and a log line) otherwise."""
        entry = self._read_sidecar(sidecar, Entry)
        if entry is None:
            return None
        try:
            size = (self.folder / entry.trace).stat().st_size
        except OSError as e:
            log.warning("library: skipped %s: %s", sidecar.name, e)
            return None
        if size != entry.trace_bytes:
            log.warning("library: skipped %s: its trace has %d bytes, not the %d saved (cut or edited)", sidecar.name,
                        size, entry.trace_bytes)
            return None
        return entry

    @staticmethod
    def _read_sidecar(sidecar: Path, kind: type[Item]) -> Item | None:
        """The sidecar's item if it is ours (small, valid, named by its id); None (and a log line) otherwise."""
        try:
            if not sidecar.is_file():
                return None
            if sidecar.stat().st_size > MAX_SIDECAR_BYTES:
                raise ValueError(f"{sidecar.stat().st_size} bytes, more than a sidecar has")
            item = kind.model_validate_json(sidecar.read_bytes())
            if item.id != sidecar.stem:
                raise ValueError(f"it names id {item.id!r}")
        except (OSError, ValueError, ValidationError) as e:  # ValidationError is a ValueError: named for the reader
            log.warning("library: skipped %s: %s", sidecar.name, str(e).splitlines()[0])
            return None
        return item

    def _write_sidecar(self, item: _Named, folder: Path | None = None) -> None:
        """Atomically: a reader sees the old sidecar or the new one, never half of one."""
        folder = folder or self.folder
        tmp = folder / f".{item.id}.json.tmp"
        tmp.write_text(item.model_dump_json(indent=1), encoding="utf-8")
        os.replace(tmp, folder / f"{item.id}.json")

    def _remove_locked(self, entry_id: str) -> None:
        """The entry's sidecar first (then it is no entry), then its trace; nothing if there is none."""
        sidecar = self.folder / f"{entry_id}.json"
        entry = self._read(sidecar) if sidecar.exists() else None
        sidecar.unlink(missing_ok=True)
        if entry is not None:
            (self.folder / entry.trace).unlink(missing_ok=True)

    def _evict_locked(self, keep: str) -> None:
        """Oldest entries out until all fit in max_bytes (the one just saved stays)."""
        entries = self.entries()
        total = sum(e.trace_bytes for e in entries)
        for old in reversed(entries):  # oldest first
            if total <= self.max_bytes:
                return
            if old.id != keep:
                log.info("library: evicted %s (%s) to stay within %d bytes", old.id, old.name, self.max_bytes)
                self._remove_locked(old.id)
                self._drop_pairs_locked(old.id)
                total -= old.trace_bytes


def pair_name(a: Entry, b: Entry, differences: list[tuple[str, Any, Any]]) -> str:
    """A pair's first name: the scenario and the settings in which the two runs differ ("memory-pressure:
    num_blocks=24 vs num_blocks=256"), else (or if that does not fit a name) the two runs' names."""
    def side(i: int) -> str:
        return ", ".join(f"{path.removeprefix('engine.')}={d[i]}" for path, *d in differences)

    names = f"{a.name} vs {b.name}"[:MAX_NAME]  # two names that fit, cut to fit together
    text = f"{a.scenario}: {side(0)} vs {side(1)}" if differences and a.scenario == b.scenario else names
    return text if fit_name(text) else names


def run_facts(run_id: str, scenario: dict | None, model: dict | None, overrides: dict[str, Any], lesson: bool,
              steps: int, requests: int, failure: str | None) -> dict[str, Any]:
    """An entry's facts (for save) from a finished run's reducer (its scenario and model) and its start."""
    name = (scenario or {}).get("name") or "run"
    model_name = (model or {}).get("name") or (scenario or {}).get("model") or "?"
    return {"id": run_id, "name": name, "scenario": name, "model": str(model_name),
            "overrides": overrides, "lesson": lesson, "steps": max(steps, 0), "requests": requests,
            "failed": failure is not None, "failure": failure}
