"""A run's viewers: each websocket client's bounded queue of events, and the resync messages they share.

The worker offers every event (as JSON text) to every watcher. A watcher that falls behind is not
waited for: its queue is dropped and it is told to resync from a fresh snapshot. Resyncing watchers
share one resync message and the events after it, so that many viewers falling behind cost one
snapshot, not one each.

Nothing here locks: the run calls every method holding the same lock as it applies events to its
reducer, so that a resync message plus the events after it is always exactly the state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.backend.server.run_errors import RunBusy

WATCHER_QUEUE_LIMIT = 4096  # events a watcher may lag behind before it is resynced instead


@dataclass
class Watcher:
    """One websocket client's view of a run: a bounded queue filled by the worker thread."""

    wake: Callable[[], None]  # called (thread-safely) when the queue goes from empty to non-empty
    limit: int = WATCHER_QUEUE_LIMIT
    queue: deque = field(default_factory=deque)
    needs_snapshot: bool = True
    wants_past: bool = False  # its resyncs carry `past` (the dashboard asks: ws ?past=1)
    dropped: int = 0  # events skipped by resyncs, for the tests and the curious

    def offer(self, event: str) -> None:
        if self.needs_snapshot:
            return
        if len(self.queue) >= self.limit:
            self.dropped += len(self.queue)
            self.queue.clear()
            self.needs_snapshot = True
        else:
            self.queue.append(event)
            if len(self.queue) == 1:
                self.wake()
            return
        self.wake()


@dataclass
class ResyncCache:
    """A resync message and the events after it: together, exactly the state now."""

    text: str
    since: list[str] = field(default_factory=list)
    stale: bool = False  # too many events since: a fresh snapshot is cheaper than replaying them

    def add(self, line: str, limit: int) -> None:
        if self.stale:
            return
        self.since.append(line)
        if len(self.since) > limit:
            self.stale, self.since = True, []


class Viewers:
    """The watchers of one run (at most `max_viewers`) and their shared resync messages."""

    def __init__(self, run_id: str, max_viewers: int | None, queue_limit: int = WATCHER_QUEUE_LIMIT) -> None:
        self.run_id = run_id
        self.max_viewers = max_viewers
        self.queue_limit = queue_limit
        self.watchers: list[Watcher] = []
        self._resyncs: dict[bool, ResyncCache] = {}  # with `past` or without -> the resync message

    def add(self, wake: Callable[[], None], wants_past: bool) -> Watcher:
        """A new viewer's queue; RunBusy when the run has max_viewers already."""
        limit = self.max_viewers
        if limit is not None and len(self.watchers) >= limit:
            raise RunBusy(f"run {self.run_id!r} has {limit} viewers already (--max-viewers)", 5)
        watcher = Watcher(wake, self.queue_limit, wants_past=wants_past)
        self.watchers.append(watcher)
        return watcher

    def remove(self, watcher: Watcher) -> None:
        if watcher in self.watchers:
            self.watchers.remove(watcher)

    def offer(self, line: str) -> None:
        """One published event, to every watcher and every resync message kept."""
        for w in self.watchers:
            w.offer(line)
        for cache in self._resyncs.values():
            cache.add(line, self.queue_limit // 2)

    def take(self, watcher: Watcher, max_events: int,
             resync_text: Callable[[bool], str]) -> tuple[str | None, list[str]]:
        """What a watcher should send next: a resync message (if it must resync) and queued events.
        resync_text(with_past) builds a fresh resync message when none is kept."""
        snapshot = None
        if watcher.needs_snapshot:
            cache = self._resync(watcher.wants_past, resync_text)
            snapshot = cache.text
            watcher.needs_snapshot = False
            watcher.queue = deque(cache.since)
        events = [watcher.queue.popleft() for _ in range(min(max_events, len(watcher.queue)))]
        return snapshot, events

    def forget_resyncs(self) -> None:
        """The state changed without an event (a pause, a speed, a failure): kept resync messages tell it wrong."""
        self._resyncs.clear()

    def resync_all(self) -> None:
        """Every watcher starts again from a fresh resync message (the state was rebuilt: a replay's seek)."""
        self._resyncs.clear()
        for w in self.watchers:
            w.needs_snapshot = True
            w.queue.clear()
            w.wake()

    def _resync(self, with_past: bool, resync_text: Callable[[bool], str]) -> ResyncCache:
        cache = self._resyncs.get(with_past)
        if cache is None or cache.stale:
            cache = self._resyncs[with_past] = ResyncCache(resync_text(with_past))
        return cache
