"""Runs as a service: each run owns an engine (or a recorded trace) on its own worker thread.

The worker steps at a watchable pace (`speed` iterations per second, 0 = unpaced), obeys pause /
resume / step / seek, and takes live requests between iterations. In lesson mode it pauses by
itself after the iteration in which a moment its scenario's lesson explains happened
(backend/events/moments.py finds them in the events it publishes), so the class sees that moment
at any speed. Every event it emits is applied to the run's reducer and handed to each watcher's
bounded queue under one lock, so that a snapshot plus the events after it is always exactly the
state. A watcher that falls behind is not waited
for: its queue is dropped and it is told to resync from a fresh snapshot. A run that keeps its whole
trace in memory (a scenario's) puts the events so far in that message too (`past`, as a replay does)
for a watcher that asks (the dashboard: `?past=1`), so that a page joining late draws every view from
step 0, not from the moment it joined; other clients keep the snapshot alone (a few MB of past would
pass the 1 MiB frame limit most websocket clients have by default).

A run may live forever (the API's): it keeps a bounded window of finished requests (its reducer's
`max_finished`) and of events (`Retention.trace_window`), so its memory and its snapshot stay
bounded whatever its age; the whole trace can stream to a file instead (`Retention.trace_dir`,
trace_file.py: a disk fault ends the file, never the run).

A run is supervised: an exception on its worker thread, or a worker late by more than
`Retention.stall_timeout_s` for what it is doing (a step, a command, its pacing), fails the run. It
then publishes one fatal `error` event (the exception's type and a short reason; the traceback goes
to the server's log only), takes nothing more (RunFailed at once, for the requests waiting on it
and any later call) and counts as finished, so the manager forgets it first to make room and
replaces the API's run with a fresh one.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.engine.request_output import Finished, RequestOutput
from kvscope.backend.errors import KvscopeError
from kvscope.backend.events.bus import EventBus, encode_event
from kvscope.backend.events.moments import Moment, MomentFinder, lesson_moments
from kvscope.backend.events.pacing import Pacing
from kvscope.backend.events.state import RunState
from kvscope.backend.model.weights import WeightCache
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario
from kvscope.backend.server.trace_file import TraceFile

log = logging.getLogger(__name__)

DEFAULT_SPEED = 4.0  # iterations per second: slow enough to watch block by block
WATCHER_QUEUE_LIMIT = 4096  # events a watcher may lag behind before it is resynced instead
# A resync carries the past up to this many events (a few MB of JSON, a second or two to rebuild in
# the dashboard); a longer run resyncs from its snapshot alone, whose views start at the join.
RESYNC_PAST_LIMIT = 50_000
T = TypeVar("T")


class RunError(KvscopeError):
    """A control or request a run cannot take; becomes a 400 with this message."""


class RunFailed(RunError):
    """The run's worker failed (a fault, or no progress in time): it takes no request or control any more."""

    def __init__(self, run_id: str, cause: str) -> None:
        super().__init__(None, f"run {run_id!r} failed: {cause}")
        self.run_id, self.cause = run_id, cause


def describe_fault(error: BaseException) -> str:
    """An exception as clients may read it: its type and the first line of its reason, without paths."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    reason = re.sub(r"(?<![\w.])(?:[A-Za-z]:)?[/\\][^\s'\"]*", "<path>", (reason.strip().splitlines() or [""])[0])
    return f"{type(error).__name__}: {reason[:200]}" if reason else type(error).__name__


class RunBusy(Exception):
    """A run (or the server) is full for now: a 429 with Retry-After, the client may try again."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Retention:
    """What a served run keeps in memory, how long it may sit paused untouched, who may queue and watch."""

    history: int | None = None  # finished requests kept in the reducer (None: all)
    trace_window: int | None = None  # events kept for /trace besides the header (None: all)
    trace_dir: str | None = None  # the whole trace, streamed to <trace_dir>/<run_id>.jsonl
    paused_ttl_s: float | None = None  # paused and untouched this long: the run expires
    max_waiting: int | None = None  # requests queued before add_request answers RunBusy
    max_viewers: int | None = None  # websocket viewers at once
    stall_timeout_s: float | None = None  # the worker this late for a step or a command: the run fails


# Already user errors with a message of their own (each becomes a 400 as it is).
def build_run(build: Callable[[], T]) -> T:
    """build(); any other failure (the engine refusing its config, memory, a file) as a RunError naming it."""
    try:
        return build()
    except KvscopeError:
        raise
    except Exception as e:  # the edge: a run that cannot start is the user's to fix, never a 500
        reason = (str(e).strip().splitlines() or [""])[0]
        raise RunError(None, f"the run could not start: {type(e).__name__}: {reason}") from e


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


class ServedRun:
    """A run the server hosts (an engine or a replay): the reducer, watchers, trace so far, pacing, controls."""

    kind = "run"
    keeps_trace = True  # a replay hands out the trace it was given instead
    dist_rows: DistRows | None = None  # an engine run keeps whole distributions; a replay has only its trace's

    def __init__(self, run_id: str, speed: float = DEFAULT_SPEED, paused: bool = False,
                 retention: Retention = Retention(), lesson: bool = False) -> None:
        self.run_id = run_id
        self.retention = retention
        self.state = RunState(max_finished=retention.history)
        self.lock = threading.Lock()
        self.watchers: list[Watcher] = []
        self.queue_limit = WATCHER_QUEUE_LIMIT
        self.header_line: str | None = None  # the trace's first line, kept whatever the window
        self.trace_lines: deque[str] = deque(maxlen=retention.trace_window)
        keeps_file = retention.trace_dir is not None and self.keeps_trace
        self._trace_file = TraceFile(retention.trace_dir, run_id) if keeps_file else None
        # A resync message (JSON) and the events published since: resyncing watchers share it, so that
        # many viewers falling behind cost one snapshot, not one each. None: build a fresh one.
        self._resync_caches: dict[bool, ResyncCache] = {}  # with `past` or without -> the resync message
        # request_id -> its API call's callback: the engine's outputs for it, or RunFailed (worker thread)
        self.listeners: dict[str, Callable[[RequestOutput | RunFailed], None]] = {}
        self.speed = speed
        self.paused = paused
        self.lesson = lesson  # pause after each iteration where a moment of `pause_at` happened
        self.pause_at: frozenset[str] = frozenset()  # from the header: the moments its lesson explains
        self.moments = MomentFinder()  # fed on the worker thread only
        self.moment: Moment | None = None  # found in the iteration being run: pause after it
        self.touched = time.monotonic()  # the last control: a paused run expires paused_ttl_s after it
        self.expired = False
        self.steps_requested = 0
        self.finished = False
        self.failure: str | None = None  # why the run failed (then it is finished and stopped too)
        # When the worker must be back at the top of its loop (time.monotonic()); None while it waits
        # for work, a resume or a command. The manager's watchdog fails a run past it.
        self.deadline: float | None = None
        self.last_t = 0.0  # the newest published event's time, for an event the run itself makes
        self.commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self.wakeup = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=f"run-{run_id}", daemon=True)
        self.stopped = False

    # ---- events -------------------------------------------------------------------------------------

    def publish(self, event: dict) -> None:
        """Subscriber of the run's bus (worker thread): reducer, trace, watchers, listeners, lesson moments."""
        if self.failure is not None and event["type"] != "error":
            return  # a stalled worker that comes back: the run ended with its fatal error event
        if event["type"] == "header":
            self.pause_at = lesson_moments(event.get("scenario"))
        if self.pause_at:
            found = [m for m in self.moments.feed(event) if m.kind in self.pause_at]
            self.moment = self.moment or (found[0] if found else None)
        fault = None
        with self.lock:
            self.state.apply(event)
            self.last_t = event["t"]
            line = encode_event(event)  # encoded once, for the trace and every watcher
            if self.keeps_trace:
                fault = self._record(line, event["type"] == "header")
            for w in self.watchers:
                w.offer(line)
            for cache in self._resync_caches.values():
                cache.add(line, self.queue_limit // 2)
        if fault is not None:  # after the lock: the error event is published like any other
            self._emit_error(f"the trace file stopped ({fault}); the run goes on without it", fatal=False)

    def _record(self, line: str, is_header: bool) -> str | None:
        """Keep the line (and write it to the trace file); a trace file fault not reported yet."""
        if is_header and self.header_line is None:
            self.header_line = line
        else:
            self.trace_lines.append(line)
        return self._trace_file.write(line) if self._trace_file is not None else None

    def attach(self, wake: Callable[[], None], wants_past: bool = False) -> Watcher:
        """A new viewer's queue; RunBusy when the run has max_viewers already."""
        watcher = Watcher(wake, self.queue_limit, wants_past=wants_past)
        limit = self.retention.max_viewers
        with self.lock:
            if limit is not None and len(self.watchers) >= limit:
                raise RunBusy(f"run {self.run_id!r} has {limit} viewers already (--max-viewers)", 5)
            self.watchers.append(watcher)
        return watcher

    def detach(self, watcher: Watcher) -> None:
        with self.lock:
            if watcher in self.watchers:
                self.watchers.remove(watcher)

    def take(self, watcher: Watcher, max_events: int = 512) -> tuple[str | None, list[str]]:
        """What a watcher should send next: a snapshot (if it must resync) and queued events, as JSON text."""
        with self.lock:
            snapshot = None
            if watcher.needs_snapshot:
                cache = self._resync_locked(watcher.wants_past)
                snapshot = cache.text
                watcher.needs_snapshot = False
                watcher.queue = deque(cache.since)
            events = [watcher.queue.popleft() for _ in range(min(max_events, len(watcher.queue)))]
        return snapshot, events

    def snapshot(self) -> dict:
        with self.lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict:
        snap = self.state.snapshot()
        snap.update(type="snapshot", run_id=self.run_id, kind=self.kind, finished=self.finished,
                    **asdict(self.pacing()))
        return snap

    def pacing(self) -> Pacing:
        """How the run goes, under the names its snapshot and the run list give it (the reducer has none)."""
        return Pacing(self.paused, self.speed, self.lesson)

    def _resync_message_locked(self) -> dict:
        """What a watcher starts (again) from: the snapshot; a replay adds the events before it."""
        return self._snapshot_locked()

    def _resync_locked(self, with_past: bool) -> ResyncCache:
        cache = self._resync_caches.get(with_past)
        if cache is None or cache.stale:
            message = encode_event(self._resync_message_locked())
            cache = self._resync_caches[with_past] = ResyncCache(self._with_past_locked(message) if with_past
                                                                 else message)
        return cache

    def _with_past_locked(self, message: str) -> str:
        """The resync message with `past`: the whole trace so far, spliced in as the JSON it already is
        (decoding and encoding thousands of events would hold the lock that long). Only when nothing was
        dropped from it: a windowed trace (the API's run) resyncs from its snapshot alone."""
        lines = self.trace_lines
        complete = self.keeps_trace and self.header_line is not None and lines.maxlen is None
        if not complete or len(lines) >= RESYNC_PAST_LIMIT:
            return message
        assert message.endswith("}")
        return message[:-1] + ',"past":[' + ",".join([self.header_line, *lines]) + "]}"

    def resync_all(self) -> None:
        with self.lock:
            self._resync_caches.clear()
            for w in self.watchers:
                w.needs_snapshot = True
                w.queue.clear()
                w.wake()

    def trace_jsonl(self) -> str:
        """The header and the newest trace_window events (all of them when nothing was dropped)."""
        with self.lock:
            lines = ([self.header_line] if self.header_line else []) + list(self.trace_lines)
        return "\n".join(lines) + ("\n" if lines else "")

    @property
    def trace_fault(self) -> str | None:
        """Why the run's trace file stopped (a full or removed disk), or None."""
        return self._trace_file.fault if self._trace_file is not None else None

    def flush_trace(self) -> Path | None:
        """The whole trace's file, flushed to disk (None: the run keeps no file, or it stopped: trace_fault)."""
        with self.lock:
            return self._trace_file.flush() if self._trace_file is not None else None

    # ---- control (any thread) ---------------------------------------------------------------------

    def control(self, action: str, value: float | int | None = None) -> None:
        if self.failure is not None:
            raise RunFailed(self.run_id, self.failure)
        with self.lock:
            self._resync_caches.clear()  # it tells paused and speed as they were
        with self.wakeup:
            self.touched = time.monotonic()
            if action in ("pause", "resume", "seek"):
                self.steps_requested = 0  # steps asked for before (a million, say) must not outlive them
            if action == "pause":
                self.paused = True
            elif action == "resume":
                self.paused = False
            elif action == "step":
                self.paused = True
                self.steps_requested += int(value or 1)
            elif action == "speed":
                if value is None or value < 0:
                    raise RunError("value", "speed must be a number of iterations per second >= 0 (0 = unpaced)")
                self.speed = float(value)
            elif action == "lesson":
                if value not in (0, 1):
                    raise RunError("value", "lesson mode is 1 (pause at the lesson's moments) or 0 (off)")
                self.lesson = bool(value)
            elif action == "seek":
                pass  # below, on the worker thread: it rebuilds the state the worker is using
            else:
                raise RunError("action", f"unknown action {action!r} (pause, resume, step, speed, lesson, seek)")
            self.wakeup.notify_all()
        if action == "seek":
            if value is None or value < 0:
                raise RunError("value", "seek needs a step number >= 0")
            self.call(lambda: self._seek(int(value)))
        self._emit_control(action, value)

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run fn on the worker thread between two iterations and return its result (RunFailed at once, or
        when the run fails before it ran, once the run has failed)."""
        future: Future = Future()
        with self.wakeup:
            if self.failure is not None:
                raise RunFailed(self.run_id, self.failure)
            self.commands.append((fn, future))
            self.wakeup.notify_all()
        return future.result(timeout=timeout)

    def start(self) -> "ServedRun":
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.wakeup:
            self.stopped = True
            self.wakeup.notify_all()
        with self.lock:
            if self._trace_file is not None:
                self._trace_file.close()

    def abort_in_flight(self, reason: str) -> None:
        """Ask the worker to end every unfinished request (shutdown); does not wait. A replay has none."""

    # ---- supervision (any thread) ----------------------------------------------------------------

    def stalled(self, now: float) -> bool:
        """Whether the worker is past its deadline (the manager's watchdog asks)."""
        deadline = self.deadline
        return deadline is not None and now > deadline and self.failure is None and not self.stopped

    def fail(self, cause: str, error: BaseException | None = None) -> None:
        """End the run as failed: one fatal error event, and every waiting request and command told at once."""
        with self.wakeup:
            if self.failure is not None or self.stopped:
                return
            self.failure, self.stopped = cause, True
            commands = list(self.commands)
            self.commands.clear()
            self.wakeup.notify_all()
        if error is not None:
            log.error("run %s failed: %s", self.run_id, cause, exc_info=error)
        else:
            frame = sys._current_frames().get(self.thread.ident)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(the worker has ended)\n"
            log.error("run %s failed: %s; its worker is at:\n%s", self.run_id, cause, where.rstrip())
        self._emit_error(f"the run failed ({cause})", fatal=True)
        with self.lock:  # after the event: a snapshot that says finished says failed and why
            self.finished = True
            self._resync_caches.clear()
        failed = RunFailed(self.run_id, cause)
        for listener in list(self.listeners.values()):  # waiting API requests: an answer now, not a timeout
            listener(failed)
        for _, future in commands:
            future.set_exception(failed)
        self.stop()

    def _emit_error(self, message: str, fatal: bool) -> None:
        """Publish an `error` event; a replay has no bus, so the run numbers it after the newest event."""
        self.publish({"type": "error", "seq": self.state.last_seq + 1, "step": self.state.step, "t": self.last_t,
                      "message": message, "fatal": fatal})

    # ---- the worker ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._work()
        except Exception as e:  # the edge of the worker thread: the run fails, the server goes on
            self.fail(describe_fault(e), e)

    def _work(self) -> None:
        next_due = time.monotonic()
        while True:
            with self.wakeup:
                self.deadline = None  # waiting for work, a resume or a command is never late
                while not self._may_step() and not self.commands and not self.stopped:
                    self.wakeup.wait(timeout=0.5)
                    self._expire_if_idle()
                if self.stopped:
                    return
                commands = list(self.commands)
                self.commands.clear()
                manual = self.paused and self.steps_requested > 0
                if manual:
                    self.steps_requested -= 1
            for fn, future in commands:
                self._due(time.monotonic())
                self._run_command(fn, future)
            if not self._may_step(manual):
                continue
            if not manual and self.speed > 0:
                next_due = max(next_due + 1.0 / self.speed, time.monotonic())  # no catch-up bursts
                self._due(next_due)  # waiting for its turn is not being late
                self._sleep_until(next_due)
                if self.paused:  # paused while it waited for its turn: that step must not run
                    continue
            self._due(time.monotonic())
            self._advance()
            self._pause_at_moment()

    def _due(self, start: float) -> None:
        """The worker starts something at `start`: it must be back stall_timeout_s after that."""
        stall = self.retention.stall_timeout_s
        self.deadline = start + stall if stall is not None else None

    def _pause_at_moment(self) -> None:
        """Lesson mode: hold the run after the iteration in which a moment its lesson explains happened."""
        moment, self.moment = self.moment, None
        if moment is None or not self.lesson or not self.has_work():
            return
        with self.lock:
            self._resync_caches.clear()  # it tells paused as it was
        with self.wakeup:
            self.paused, self.touched = True, time.monotonic()
        self._record_control("pause", moment.kind)

    def _may_step(self, manual: bool = False) -> bool:
        if not self.has_work():
            return False
        return manual or not self.paused or self.steps_requested > 0

    def _sleep_until(self, deadline: float) -> None:
        with self.wakeup:
            while not self.stopped and time.monotonic() < deadline and not self.paused and not self.commands:
                self.wakeup.wait(timeout=deadline - time.monotonic())

    def _expire_if_idle(self) -> None:
        """Paused and untouched for paused_ttl_s (holding self.wakeup): the run stops, its memory can go."""
        ttl = self.retention.paused_ttl_s
        if ttl is not None and self.paused and time.monotonic() - self.touched > ttl:
            self._expire()

    def _expire(self) -> None:
        self.expired = self.stopped = True

    @staticmethod
    def _run_command(fn: Callable[[], Any], future: Future) -> None:
        try:
            future.set_result(fn())
        except Exception as e:  # delivered to the caller's thread, which turns it into a 4xx
            future.set_exception(e)

    # ---- what subclasses provide ------------------------------------------------------------------

    def has_work(self) -> bool:
        raise NotImplementedError

    def _advance(self) -> None:
        raise NotImplementedError

    def _seek(self, step: int) -> None:
        raise RunError("action", "seek works on replays only")

    def _emit_control(self, action: str, value: Any) -> None:
        """Recorded as an event so that a replay shows when the class paused (from any thread)."""

    def _record_control(self, action: str, value: Any) -> None:
        """The same, on the worker thread. A replay records none: its events are the trace it was given."""

    def describe(self) -> dict:
        return {"run_id": self.run_id, "kind": self.kind, "scenario": (self.state.scenario or {}).get("name"),
                **asdict(self.pacing()), "finished": self.finished,
                "failed": self.failure is not None, "step": self.state.step}


class EngineRun(ServedRun):
    """A scenario (or the API's open-ended run) on a real engine."""

    kind = "scenario"

    def __init__(self, scenario: Scenario, speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None, open_ended: bool = False, retention: Retention = Retention(),
                 lesson: bool = False, weights: WeightCache | None = None) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], speed, paused, retention, lesson)
        self.scenario = scenario
        self.open_ended = open_ended  # the API run waits for requests forever
        self.bus = EventBus(level=scenario.engine.events)
        self.bus.subscribe(self.publish)
        self.sim = ScenarioRun(scenario, self.bus, weights=weights)  # the server's shared weight copies
        self.dist_rows = DistRows()  # whole raw rows of recent tokens, for the what-if (GET .../dist)
        self.sim.engine.events.rows = self.dist_rows
        self.sim.engine.stream_outputs(self._deliver)
        self._live_counter = 0
        self.adds_pending = 0  # add_request calls on their way to the worker thread
        self.finished_ids: list[str] = []  # requests finished this step: the open-ended run forgets them after it
        if open_ended:
            self.kind = "api"

    def has_work(self) -> bool:
        return not self.sim.done

    def _deliver(self, output: RequestOutput) -> None:
        """The engine's answer for one request (worker thread), to the API call waiting for it."""
        if self.failure is not None:
            return  # a stalled worker that comes back: its callers were told RunFailed already
        listener = self.listeners.get(output.request_id)
        if listener is not None:
            listener(output)
        if isinstance(output, Finished):
            self.listeners.pop(output.request_id, None)
            if self.open_ended:
                self.finished_ids.append(output.request_id)

    def _advance(self) -> None:
        self.sim.step()
        for rid in self.finished_ids:  # after the step: the engine may still read a request it just finished
            self.sim.engine.forget(rid)
        self.finished_ids.clear()
        if self.sim.done and not self.open_ended and not self.finished:
            self.finished = True
            self.sim.finish()

    def _emit_control(self, action: str, value: Any) -> None:
        self.call(lambda: self._record_control(action, value))

    def _record_control(self, action: str, value: Any) -> None:
        self.bus.emit("control", action=action, value=value)

    def _emit_error(self, message: str, fatal: bool) -> None:
        self.bus.emit("error", message=message, fatal=fatal)

    def _expire(self) -> None:
        if not self.open_ended:
            super()._expire()
            return
        self.paused = False  # the API's run is the service: it resumes rather than leave requests waiting
        with self.lock:
            self._resync_caches.clear()
        self.bus.emit("control", action="resume", value=None)

    def abort_in_flight(self, reason: str) -> None:
        with self.lock:
            in_flight = [*self.state.waiting, *self.state.running]

        def abort_all() -> None:
            for rid in in_flight:
                self.sim.engine.abort(rid, reason)

        with self.wakeup:
            self.commands.append((abort_all, Future()))
            self.wakeup.notify_all()

    def check_room(self, count: int = 1) -> None:
        """RunBusy if the waiting queue cannot take `count` more requests."""
        with self.lock:
            self._check_room_locked(count)

    def _check_room_locked(self, count: int) -> None:
        limit = self.retention.max_waiting
        waiting = len(self.state.waiting) + self.adds_pending
        if limit is not None and waiting + count > limit:
            raise RunBusy(f"run {self.run_id!r} has {waiting} requests waiting, at most {limit} may wait "
                          "(--max-waiting); try again shortly")

    def add_request(self, prompt: str, max_tokens: int, sampling: dict | None,
                    listener: Callable[[RequestOutput | RunFailed], None] | None = None,
                    request_id: str | None = None) -> str:
        """Add a request live (validated on the worker thread; RequestError if refused, RunBusy if the
        waiting queue is full)."""
        with self.lock:
            self._check_room_locked(1)
            self.adds_pending += 1

        def add() -> str:
            with self.lock:
                self.adds_pending -= 1
            self._live_counter += 1
            rid = request_id or f"live-{self._live_counter}"
            if listener is not None:
                self.listeners[rid] = listener
            try:
                self.sim.engine.add_request(rid, prompt, max_tokens, sampling)
            except Exception:
                self.listeners.pop(rid, None)
                raise
            if self.finished:  # a finished run wakes up for a live request
                self.finished = False
            return rid

        try:
            return self.call(add)
        except TimeoutError:
            raise RunBusy(f"run {self.run_id!r} did not take the request in time; try again shortly") from None

    def describe(self) -> dict:
        """The summary, plus the run's model and whether it has a chat template (the dashboard's chat switch)."""
        return {**super().describe(), "model": self.scenario.model,
                "chat_template": self.sim.loaded.tokenizer.chat_template is not None}

    def abort_request(self, request_id: str) -> None:
        self.call(lambda: self.sim.engine.abort(request_id, "the client went away"))
