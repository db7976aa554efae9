"""Runs as a service: a served run assembles its parts around one reducer and one worker thread.

A run hosts an engine (engine_run.py: a scenario's, or the OpenAI API's in api_run.py) or a recorded
trace (replay.py), built from these parts:

    run_worker.py     the worker thread, the commands it runs between iterations, and its supervision
    run_pacing.py     speed, pause / resume / step / seek, lesson mode's pauses, a paused run's expiry
    run_viewers.py    each websocket viewer's bounded queue, and the resync messages they share
    run_trace.py      the trace kept: a window in memory, the whole of it on disk
    live_requests.py  (an engine run's) the API calls waiting on the engine

ServedRun is what the manager and the routes hold. Every event the worker publishes is applied to
the reducer, kept in the trace and offered to the viewers under one lock, so that a snapshot plus
the events after it is always exactly the state. A run that keeps its whole trace in memory (a
scenario's) puts the events so far in a resync message too (`past`, as a replay does) for a watcher
that asks (the dashboard: `?past=1`), so that a page joining late draws every view from step 0;
other clients keep the snapshot alone (a few MB of past would pass the 1 MiB frame limit most
websocket clients have by default).

A run that fails (run_worker.py says when) publishes one fatal `error` event (the exception's type
and a short reason), takes nothing more (RunFailed at once, for the requests waiting on it and any
later call) and counts as finished, so the manager forgets it first to make room and replaces the
API's run with a fresh one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.events.bus import encode_event
from kvscope.backend.events.state import RunState
from kvscope.backend.server.run_errors import RunError, RunFailed
from kvscope.backend.server.run_pacing import DEFAULT_SPEED, LessonMoments, Pacer
from kvscope.backend.server.run_trace import RunTrace
from kvscope.backend.server.run_viewers import Viewers, Watcher
from kvscope.backend.server.run_worker import RunWorker

T = TypeVar("T")


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
    grammar_cache_bytes: int | None = None  # an engine run's compiled grammars (None: the engine's default)


class ServedRun:
    """A run the server hosts (an engine or a replay): its reducer and the parts around it."""

    kind = "run"
    keeps_trace = True  # a replay hands out the trace it was given instead
    records_controls = False  # whether a control becomes an event of its own (_record_control)
    dist_rows: DistRows | None = None  # an engine run keeps whole distributions; a replay has only its trace's

    def __init__(self, run_id: str, speed: float = DEFAULT_SPEED, paused: bool = False,
                 retention: Retention = Retention(), lesson: bool = False) -> None:
        self.run_id = run_id
        self.state = RunState(max_finished=retention.history)
        self.lock = threading.Lock()  # the reducer, the trace and the viewers change together under it
        self.viewers = Viewers(run_id, retention.max_viewers)
        self.trace = RunTrace(run_id, retention.trace_window, retention.trace_dir if self.keeps_trace else None)
        self.pacing = Pacer(speed, paused, lesson)  # changed under self.worker.wakeup
        self.lesson_moments = LessonMoments()
        self.worker = RunWorker(run_id, self, self.pacing, retention.stall_timeout_s, retention.paused_ttl_s)
        self.finished = False
        self.expired = False
        # Told the run's id once its worker has ended after an expiry (manager.py: the run's memory goes then).
        self.on_expired: Callable[[str], None] | None = None
        self.last_t = 0.0  # the newest published event's time, for an event the run itself makes

    # ---- events (the worker thread) -------------------------------------------------------------------

    def publish(self, event: dict) -> None:
        """Subscriber of the run's bus: reducer, trace, viewers, lesson moments."""
        if self.failure is not None and event["type"] != "error":
            return  # a stalled worker that comes back: the run ended with its fatal error event
        self.lesson_moments.feed(event)
        fault = None
        with self.lock:
            self.state.apply(event)
            self.last_t = event["t"]
            line = encode_event(event)  # encoded once, for the trace and every viewer
            if self.keeps_trace:
                fault = self.trace.record(line, event["type"] == "header")
            self.viewers.offer(line)
        if fault is not None:  # after the lock: the error event is published like any other
            self._emit_error(f"the trace file stopped ({fault}); the run goes on without it", fatal=False)

    def _emit_error(self, message: str, fatal: bool) -> None:
        """Publish an `error` event; a replay has no bus, so the run numbers it after the newest event."""
        self.publish({"type": "error", "seq": self.state.last_seq + 1, "step": self.state.step, "t": self.last_t,
                      "message": message, "fatal": fatal})

    # ---- viewers (any thread) ---------------------------------------------------------------------------

    def attach(self, wake: Callable[[], None], wants_past: bool = False) -> Watcher:
        """A new viewer's queue; RunBusy when the run has max_viewers already."""
        with self.lock:
            return self.viewers.add(wake, wants_past)

    def detach(self, watcher: Watcher) -> None:
        with self.lock:
            self.viewers.remove(watcher)

    def take(self, watcher: Watcher, max_events: int = 512) -> tuple[str | None, list[str]]:
        """What a watcher should send next: a snapshot (if it must resync) and queued events, as JSON text."""
        with self.lock:
            return self.viewers.take(watcher, max_events, self._resync_text_locked)

    def resync_all(self) -> None:
        with self.lock:
            self.viewers.resync_all()

    def snapshot(self) -> dict:
        with self.lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict:
        snap = self.state.snapshot()
        snap.update(type="snapshot", run_id=self.run_id, kind=self.kind, finished=self.finished,
                    **asdict(self.pacing.view()))
        return snap

    def _resync_message_locked(self) -> dict:
        """What a watcher starts (again) from: the snapshot; a replay adds the events before it."""
        return self._snapshot_locked()

    def _resync_text_locked(self, with_past: bool) -> str:
        message = encode_event(self._resync_message_locked())
        return self.trace.with_past(message) if with_past else message

    # ---- the trace (any thread) -----------------------------------------------------------------------

    def trace_jsonl(self) -> str:
        """The header and the newest trace_window events (all of them when nothing was dropped)."""
        with self.lock:
            return self.trace.jsonl()

    @property
    def trace_fault(self) -> str | None:
        """Why the run's trace file stopped (a full or removed disk), or None."""
        return self.trace.fault

    def flush_trace(self) -> Path | None:
        """The whole trace's file, flushed to disk (None: the run keeps no file, or it stopped: trace_fault)."""
        with self.lock:
            return self.trace.flush()

    # ---- control and lifecycle (any thread) -------------------------------------------------------------

    def control(self, action: str, value: float | int | None = None) -> None:
        if self.failure is not None:
            raise RunFailed(self.run_id, self.failure)
        with self.lock:
            self.viewers.forget_resyncs()  # they tell paused and speed as they were
        if action == "seek":  # on the worker thread: it rebuilds the state the worker is using
            self.worker.steer(lambda: self.pacing.apply(action, value))
            self.call(lambda: (self._seek(int(value)), self._record_control(action, value)))
        elif self.records_controls:  # recorded before any iteration the change lets run: its replay pauses there too
            self.worker.steer(lambda: self.pacing.apply(action, value),
                              then=lambda: self._record_control(action, value))
        else:
            self.worker.steer(lambda: self.pacing.apply(action, value))

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run fn on the worker thread between two iterations and return its result (RunFailed at once, or
        when the run fails before it ran, once the run has failed)."""
        return self.worker.call(fn, timeout)

    def start(self) -> "ServedRun":
        self.worker.start()
        return self

    def stop(self) -> None:
        self.worker.stop()
        with self.lock:
            self.trace.close()

    def abort_in_flight(self, reason: str) -> None:
        """Ask the worker to end every unfinished request (shutdown); does not wait. A replay has none."""

    def release(self) -> None:
        """Free what the run holds outside memory, on its worker thread as it ends (a replay holds nothing)."""

    def ended(self) -> None:
        if self.expired and self.on_expired is not None:
            self.on_expired(self.run_id)

    @property
    def failure(self) -> str | None:
        """Why the run failed (then it is finished and stopped too), or None."""
        return self.worker.failure

    def stalled(self, now: float) -> bool:
        """Whether the worker is past its deadline (the manager's watchdog asks)."""
        return self.worker.stalled(now)

    def fail(self, cause: str, error: BaseException | None = None) -> None:
        """End the run as failed: one fatal error event, and every waiting request and command told at once."""
        commands = self.worker.fail(cause, error)
        if commands is None:
            return
        self._emit_error(f"the run failed ({cause})", fatal=True)
        with self.lock:  # after the event: a snapshot that says finished says failed and why
            self.finished = True
            self.viewers.forget_resyncs()
        failed = RunFailed(self.run_id, cause)
        self._answer_waiting(failed)
        for future in commands:
            future.set_exception(failed)
        self.stop()

    def _answer_waiting(self, failed: RunFailed) -> None:
        """Tell the callers waiting on the run's outputs that it failed (an engine run's API requests)."""

    # ---- what the worker drives (its thread) ------------------------------------------------------------

    def iterate(self) -> None:
        self._advance()
        self._pause_at_moment()

    def expire(self) -> bool:
        """Paused and untouched for paused_ttl_s: the run stops, and the manager lets its memory go."""
        self.expired = True
        return True

    def _pause_at_moment(self) -> None:
        """Lesson mode: hold the run after the iteration in which a moment its lesson explains happened."""
        moment = self.lesson_moments.take()
        if moment is None or not self.pacing.lesson or not self.has_work():
            return
        with self.lock:
            self.viewers.forget_resyncs()  # they tell paused as it was
        self.worker.steer(self.pacing.hold)
        self._record_control("pause", moment.kind)

    # ---- what subclasses provide ------------------------------------------------------------------------

    def has_work(self) -> bool:
        raise NotImplementedError

    def _advance(self) -> None:
        raise NotImplementedError

    def _seek(self, step: int) -> None:
        raise RunError("action", "seek works on replays only")

    def _record_control(self, action: str, value: Any) -> None:
        """A control recorded as an event (on the worker thread), so that a replay shows when the class paused.
        A replay records none: its events are the trace it was given."""

    def describe(self) -> dict:
        return {"run_id": self.run_id, "kind": self.kind, "scenario": (self.state.scenario or {}).get("name"),
                **asdict(self.pacing.view()), "finished": self.finished, "failed": self.failure is not None,
                "step": self.state.step}
