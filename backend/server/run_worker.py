"""A run's worker thread and its supervision: the one thread that touches the engine (or the replay).

The worker runs the run's iterations at the pace its Pacer allows, and between two iterations the
commands other threads hand it (`call`: a live request, an abort, a seek), so the engine is never
touched by two threads. It is the supervisor between the server and the engine: an exception on the
thread, or a worker late by more than `stall_timeout_s` for what it is doing (a step, a command, its
pacing; the manager's watchdog asks `stalled`), fails the run (DrivenRun.fail). The run's `fail` has the
worker stop first (`fail` here: it logs where the worker was, the traceback going to the server's log
only, and hands back the commands that will never run), then tells its clients.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from kvscope.backend.server.memory import give_back_memory
from kvscope.backend.server.run_errors import RunFailed, describe_fault
from kvscope.backend.server.run_pacing import Pacer

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_CHECK_S = 0.5  # how often a waiting worker looks whether its paused run has expired


class DrivenRun(Protocol):
    """The run as its worker sees it: iterations to drive, an expiry, a failure."""

    def has_work(self) -> bool: ...

    def iterate(self) -> None:
        """One iteration and what follows it (a lesson pause)."""

    def expire(self) -> bool:
        """Paused and untouched too long (the worker's lock held); True: the worker stops."""

    def fail(self, cause: str, error: BaseException | None = None) -> None: ...

    def release(self) -> None:
        """What the run holds outside memory (a tensor-parallel engine's ranks), freed as its worker ends."""

    def ended(self) -> None:
        """Its worker's last act, after release, holding no lock: whoever holds the run hears that it ended."""


class RunWorker:
    """The thread, the commands waiting for it, and its deadline; `wakeup` guards them and the Pacer."""

    def __init__(self, run_id: str, run: DrivenRun, pacing: Pacer, stall_timeout_s: float | None = None,
                 paused_ttl_s: float | None = None) -> None:
        self.run_id = run_id
        self.run: DrivenRun | None = run  # let go as the thread ends (_loop)
        self.pacing = pacing
        self.stall_timeout_s = stall_timeout_s
        self.paused_ttl_s = paused_ttl_s
        self.wakeup = threading.Condition()
        self.commands: deque[tuple[Callable[[], Any], Future]] = deque()
        # When the worker must be back at the top of its loop (time.monotonic()); None while it waits
        # for work, a resume or a command. The manager's watchdog fails a run past it.
        self.deadline: float | None = None
        self.stopped = False
        self.failure: str | None = None  # why the run failed (then it is stopped too)
        self.thread = threading.Thread(target=self._loop, name=f"run-{run_id}", daemon=True)

    # ---- any thread ---------------------------------------------------------------------------------

    def steer(self, change: Callable[[], T], then: Callable[[], Any] | None = None, timeout: float = 30.0) -> T:
        """change() (of the pacing, say) under the worker's lock, then wake the worker to obey it.

        then(): queued in the same breath, so the worker runs it before any iteration the change allows (a
        resume's control event comes before the iteration it lets run); waited for, as `call` does."""
        with self.wakeup:
            if then is not None and self.failure is not None:
                raise RunFailed(self.run_id, self.failure)
            result = change()
            future = self.submit(then) if then is not None else None
            self.wakeup.notify_all()
        if future is not None:
            future.result(timeout=timeout)
        return result

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue fn to run on the worker between two iterations; does not wait for it."""
        future: Future = Future()
        with self.wakeup:
            self.commands.append((fn, future))
            self.wakeup.notify_all()
        return future

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """fn's result, run on the worker (RunFailed at once, or when the run fails before it ran, once
        the run has failed)."""
        with self.wakeup:  # a reentrant lock: the check and the queueing are one step for `fail`
            if self.failure is not None:
                raise RunFailed(self.run_id, self.failure)
            future = self.submit(fn)
        return future.result(timeout=timeout)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.wakeup:
            self.stopped = True
            self.wakeup.notify_all()

    def stalled(self, now: float) -> bool:
        """Whether the worker is past its deadline (the manager's watchdog asks)."""
        deadline = self.deadline
        return deadline is not None and now > deadline and self.failure is None and not self.stopped

    def fail(self, cause: str, error: BaseException | None) -> list[Future] | None:
        """Stop as failed and log where the worker was; the commands that will never run (None: the run
        had failed or stopped already)."""
        with self.wakeup:
            if self.failure is not None or self.stopped:
                return None
            self.failure, self.stopped = cause, True
            futures = [future for _, future in self.commands]
            self.commands.clear()
            self.wakeup.notify_all()
        if error is not None:
            log.error("run %s failed: %s", self.run_id, cause, exc_info=error)
        else:
            frame = sys._current_frames().get(self.thread.ident)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(the worker has ended)\n"
            log.error("run %s failed: %s; its worker is at:\n%s", self.run_id, cause, where.rstrip())
        return futures

    # ---- the worker thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._work()
        except Exception as e:  # the edge of the worker thread: the run fails, the server goes on
            self.run.fail(describe_fault(e), e)
        finally:  # on this thread, which alone touches the engine: no step can be under way
            self.run.release()
            self.run.ended()
            # The run holds its worker and the worker its run: a cycle that only a full collection frees, so a
            # forgotten run (a replay's parsed trace: hundreds of MB) stayed in memory until one. This thread
            # is done with it; once the manager has let go too, it is freed, and its pages given back.
            self.run = None
            give_back_memory()

    def _work(self) -> None:
        next_due = time.monotonic()
        while True:
            work = self._wait_for_work()
            if work is None:
                return
            commands, manual = work
            for fn, future in commands:
                self._due(time.monotonic())
                _run_command(fn, future)
            if not self.pacing.may_step(self.run.has_work(), manual):
                continue
            if not manual and self.pacing.speed > 0:
                next_due = self.pacing.next_due(next_due, time.monotonic())
                self._due(next_due)  # waiting for its turn is not being late
                self._sleep_until(next_due)
                if self.pacing.paused:  # paused while it waited for its turn: that step must not run
                    continue
            self._due(time.monotonic())
            self.run.iterate()

    def _wait_for_work(self) -> tuple[list[tuple[Callable[[], Any], Future]], bool] | None:
        """Once there is work or a command: the commands queued, and whether the next iteration is a
        manual step. None once the worker is stopped."""
        with self.wakeup:
            self.deadline = None  # waiting for work, a resume or a command is never late
            while not self.pacing.may_step(self.run.has_work()) and not self.commands and not self.stopped:
                self.wakeup.wait(timeout=IDLE_CHECK_S)
                self._expire_if_idle()
            if self.stopped:
                return None
            commands = list(self.commands)
            self.commands.clear()
            return commands, self.pacing.take_manual_step()

    def _due(self, start: float) -> None:
        """The worker starts something at `start`: it must be back stall_timeout_s after that."""
        stall = self.stall_timeout_s
        self.deadline = start + stall if stall is not None else None

    def _sleep_until(self, deadline: float) -> None:
        with self.wakeup:
            while not self.stopped and time.monotonic() < deadline and not self.pacing.paused and not self.commands:
                self.wakeup.wait(timeout=deadline - time.monotonic())

    def _expire_if_idle(self) -> None:
        """Paused and untouched for paused_ttl_s (holding self.wakeup): the run stops, its memory can go."""
        if self.pacing.idle_past(self.paused_ttl_s, time.monotonic()) and self.run.expire():
            self.stopped = True


def _run_command(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except Exception as e:  # delivered to the caller's thread, which turns it into a 4xx
        future.set_exception(e)
