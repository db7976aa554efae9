"""Runs as a service: each run owns an engine (or a recorded trace) on its own worker thread.

The worker steps at a watchable pace (`speed` iterations per second, 0 = unpaced), obeys pause /
resume / step / seek, and takes live requests between iterations. Every event it emits is applied
to the run's reducer and handed to each watcher's bounded queue under one lock, so that a snapshot
plus the events after it is always exactly the state. A watcher that falls behind is not waited
for: its queue is dropped and it is told to resync from a fresh snapshot.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backend.errors import KvscopeError
from backend.events.bus import EventBus
from backend.events.state import RunState
from backend.run import ScenarioRun
from backend.scenario import Scenario

DEFAULT_SPEED = 4.0  # iterations per second: slow enough to watch block by block
WATCHER_QUEUE_LIMIT = 4096  # events a watcher may lag behind before it is resynced instead
T = TypeVar("T")


class RunError(KvscopeError):
    """A control or request a run cannot take; becomes a 400 with this message."""


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


class ServedRun:
    """A run the server hosts (an engine or a replay): the reducer, watchers, trace so far, pacing, controls."""

    kind = "run"
    keeps_trace = True  # a replay hands out the trace it was given instead

    def __init__(self, run_id: str, speed: float = DEFAULT_SPEED, paused: bool = False) -> None:
        self.run_id = run_id
        self.state = RunState()
        self.lock = threading.Lock()
        self.watchers: list[Watcher] = []
        self.queue_limit = WATCHER_QUEUE_LIMIT
        self.trace_lines: list[str] = []
        self.listeners: dict[str, Callable[[dict], None]] = {}  # request_id -> callback (API streaming)
        self.speed = speed
        self.paused = paused
        self.steps_requested = 0
        self.finished = False
        self.commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self.wakeup = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=f"run-{run_id}", daemon=True)
        self.stopped = False

    # ---- events -------------------------------------------------------------------------------------

    def publish(self, event: dict) -> None:
        """Subscriber of the run's bus (worker thread): reducer, trace, watchers, listeners."""
        with self.lock:
            self.state.apply(event)
            line = json.dumps(event, separators=(",", ":"))  # encoded once, for the trace and every watcher
            if self.keeps_trace:
                self.trace_lines.append(line)
            for w in self.watchers:
                w.offer(line)
        rid = event.get("request_id")
        if rid is not None and rid in self.listeners:
            self.listeners[rid](event)

    def attach(self, wake: Callable[[], None]) -> Watcher:
        watcher = Watcher(wake, self.queue_limit)
        with self.lock:
            self.watchers.append(watcher)
        return watcher

    def detach(self, watcher: Watcher) -> None:
        with self.lock:
            if watcher in self.watchers:
                self.watchers.remove(watcher)

    def take(self, watcher: Watcher, max_events: int = 512) -> tuple[dict | None, list[str]]:
        """What a watcher should send next: a snapshot (if it must resync) and queued events (JSON text)."""
        with self.lock:
            snapshot = None
            if watcher.needs_snapshot:
                snapshot = self._resync_message_locked()
                watcher.needs_snapshot = False
                watcher.queue.clear()
            events = [watcher.queue.popleft() for _ in range(min(max_events, len(watcher.queue)))]
        return snapshot, events

    def snapshot(self) -> dict:
        with self.lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict:
        snap = self.state.snapshot()
        snap.update(type="snapshot", run_id=self.run_id, kind=self.kind, paused=self.paused, speed=self.speed,
                    finished=self.finished)
        return snap

    def _resync_message_locked(self) -> dict:
        """What a watcher starts (again) from: the snapshot; a replay adds the events before it."""
        return self._snapshot_locked()

    def resync_all(self) -> None:
        with self.lock:
            for w in self.watchers:
                w.needs_snapshot = True
                w.queue.clear()
                w.wake()

    def trace_jsonl(self) -> str:
        with self.lock:
            return "\n".join(self.trace_lines) + ("\n" if self.trace_lines else "")

    # ---- control (any thread) ---------------------------------------------------------------------

    def control(self, action: str, value: float | int | None = None) -> None:
        with self.wakeup:
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
            elif action == "seek":
                pass  # below, on the worker thread: it rebuilds the state the worker is using
            else:
                raise RunError("action", f"unknown action {action!r} (pause, resume, step, speed, seek)")
            self.wakeup.notify_all()
        if action == "seek":
            if value is None or value < 0:
                raise RunError("value", "seek needs a step number >= 0")
            self.call(lambda: self._seek(int(value)))
        self._emit_control(action, value)

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run fn on the worker thread between two iterations and return its result."""
        future: Future = Future()
        with self.wakeup:
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

    # ---- the worker ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        next_due = time.perf_counter()
        while True:
            with self.wakeup:
                while not self._may_step() and not self.commands and not self.stopped:
                    self.wakeup.wait(timeout=0.5)
                if self.stopped:
                    return
                commands = list(self.commands)
                self.commands.clear()
                manual = self.paused and self.steps_requested > 0
                if manual:
                    self.steps_requested -= 1
            for fn, future in commands:
                self._run_command(fn, future)
            if not self._may_step(manual):
                continue
            if not manual and self.speed > 0:
                next_due = max(next_due + 1.0 / self.speed, time.perf_counter())  # no catch-up bursts
                self._sleep_until(next_due)
                if self.paused:  # paused while it waited for its turn: that step must not run
                    continue
            self._advance()

    def _may_step(self, manual: bool = False) -> bool:
        if not self.has_work():
            return False
        return manual or not self.paused or self.steps_requested > 0

    def _sleep_until(self, deadline: float) -> None:
        with self.wakeup:
            while not self.stopped and time.perf_counter() < deadline and not self.paused and not self.commands:
                self.wakeup.wait(timeout=deadline - time.perf_counter())

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
        """Recorded as an event so that a replay shows when the class paused."""

    def describe(self) -> dict:
        return {"run_id": self.run_id, "kind": self.kind, "scenario": (self.state.scenario or {}).get("name"),
                "paused": self.paused, "speed": self.speed, "finished": self.finished, "step": self.state.step}


class EngineRun(ServedRun):
    """A scenario (or the API's open-ended run) on a real engine."""

    kind = "scenario"

    def __init__(self, scenario: Scenario, speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None, open_ended: bool = False) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], speed, paused)
        self.scenario = scenario
        self.open_ended = open_ended  # the API run waits for requests forever
        self.bus = EventBus(level=scenario.engine.events)
        self.bus.subscribe(self.publish)
        self.sim = ScenarioRun(scenario, self.bus)
        self._live_counter = 0
        if open_ended:
            self.kind = "api"

    def has_work(self) -> bool:
        return not self.sim.done

    def _advance(self) -> None:
        self.sim.step()
        if self.sim.done and not self.open_ended and not self.finished:
            self.finished = True
            self.sim.finish()

    def _emit_control(self, action: str, value: Any) -> None:
        self.call(lambda: self.bus.emit("control", action=action, value=value))

    def add_request(self, prompt: str, max_tokens: int, sampling: dict | None,
                    listener: Callable[[dict], None] | None = None, request_id: str | None = None) -> str:
        """Add a request live (validated on the worker thread; RequestError if refused)."""

        def add() -> str:
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

        return self.call(add)

    def describe(self) -> dict:
        """The summary, plus the run's model and whether it has a chat template (the dashboard's chat switch)."""
        return {**super().describe(), "model": self.scenario.model,
                "chat_template": self.sim.loaded.tokenizer.chat_template is not None}

    def forget_listener(self, request_id: str) -> None:
        self.listeners.pop(request_id, None)

    def abort_request(self, request_id: str) -> None:
        self.call(lambda: self.sim.engine.abort(request_id, "the client went away"))
