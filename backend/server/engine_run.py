"""A scenario (or the API's open-ended run) served on a real engine.

The engine lives on the run's worker thread: live requests, aborts and the engine's answers all
pass through it (live_requests.py holds the API calls waiting on them). The routes read the model
through `loaded` and `max_model_len`, never through the engine, which only the worker touches; what
the server decides by (admission's waiting count, the shutdown's aborts, the /metrics gauges) is the
engine's own count, `Engine.stats`, a snapshot it replaces whole and any thread may read: never the
reducer's, whose events may be off (--api-events off has no iteration events to say what runs).
"""

from __future__ import annotations

import uuid
from typing import Any

from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.engine.request_output import RequestOutput
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.weights import WeightCache
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario
from kvscope.backend.server.live_requests import Listener, LiveRequests
from kvscope.backend.server.run_errors import RunBusy, RunFailed
from kvscope.backend.server.run_pacing import DEFAULT_SPEED
from kvscope.backend.server.runs import Retention, ServedRun


class EngineRun(ServedRun):
    """A scenario (or the API's open-ended run) on a real engine."""

    kind = "scenario"
    records_controls = True

    def __init__(self, scenario: Scenario, speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None, open_ended: bool = False, retention: Retention = Retention(),
                 lesson: bool = False, weights: WeightCache | None = None) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], speed, paused, retention, lesson)
        self.scenario = scenario
        self.open_ended = open_ended  # the API run waits for requests forever
        if open_ended:
            self.kind = "api"
        self.bus = EventBus(level=scenario.engine.events)
        self.bus.subscribe(self.publish)
        self.sim = ScenarioRun(scenario, self.bus, weights=weights)  # the server's shared weight copies
        self.loaded = self.sim.loaded  # read-only for the routes: the tokenizer, the model's config and folder
        self.max_model_len = self.sim.engine.config.max_model_len
        self.dist_rows = DistRows()  # whole raw rows of recent tokens, for the what-if (GET .../dist)
        self.sim.engine.events.rows = self.dist_rows
        self.requests = LiveRequests(self.run_id, retention.max_waiting, forgets_finished=open_ended)
        self.sim.engine.stream_outputs(self._deliver)

    def has_work(self) -> bool:
        return not self.sim.done

    def _deliver(self, output: RequestOutput) -> None:
        """The engine's answer for one request (worker thread), to the API call waiting for it."""
        if self.failure is None:  # else a stalled worker that came back: its callers were told RunFailed
            self.requests.deliver(output)

    def _advance(self) -> None:
        self.sim.step()
        for rid in self.requests.take_finished():  # after the step: the engine may still read a request it finished
            self.sim.engine.forget(rid)
        if self.sim.done and not self.open_ended and not self.finished:
            self.finished = True
            self.sim.finish()

    def _record_control(self, action: str, value: Any) -> None:
        self.bus.emit("control", action=action, value=value)

    def _emit_error(self, message: str, fatal: bool) -> None:
        self.bus.emit("error", message=message, fatal=fatal)

    def _answer_waiting(self, failed: RunFailed) -> None:
        self.requests.fail_all(failed)

    def expire(self) -> bool:
        if not self.open_ended:
            return super().expire()
        self.pacing.paused = False  # the API's run is the service: it resumes rather than leave requests waiting
        with self.lock:
            self.viewers.forget_resyncs()
        self.bus.emit("control", action="resume", value=None)
        return False

    def release(self) -> None:
        self.sim.engine.close()  # a tensor-parallel engine's other ranks stop

    def abort_in_flight(self, reason: str) -> None:
        engine = self.sim.engine
        self.worker.submit(lambda: engine.abort_all(reason))

    def check_room(self, count: int = 1) -> None:
        """RunBusy if the waiting queue cannot take `count` more requests."""
        with self.lock:
            self.requests.check_room(self.sim.engine.stats.num_waiting, count)

    def add_request(self, prompt: str | list[int], max_tokens: int, sampling: dict | None,
                    listener: Listener | None = None, request_id: str | None = None) -> str:
        """Add a request live (validated on the worker thread; RequestError if refused, RunBusy if the
        waiting queue is full). It arrives now, on this thread: its TTFT and queue time include the wait
        for the worker to finish the step under way, as a client sees them (and vLLM counts them)."""
        arrival = self.sim.engine.clock()
        with self.lock:
            self.requests.check_room(self.sim.engine.stats.num_waiting, 1)
            self.requests.adds_pending += 1
        try:
            return self.call(lambda: self._add_on_worker(prompt, max_tokens, sampling, listener, request_id, arrival))
        except TimeoutError:
            raise RunBusy(f"run {self.run_id!r} did not take the request in time; try again shortly") from None

    def _add_on_worker(self, prompt: str | list[int], max_tokens: int, sampling: dict | None,
                       listener: Listener | None, request_id: str | None, arrival: float) -> str:
        rid = self.requests.listen(request_id, listener)
        try:
            self.sim.engine.add_request(rid, prompt, max_tokens, sampling, arrival)
        except Exception:
            self.requests.drop(rid)
            raise
        finally:  # after the add: a room check in between counts the request once at least, never not at all
            with self.lock:
                self.requests.adds_pending -= 1
        self.finished = False  # a finished run wakes up for a live request
        return rid

    def describe(self) -> dict:
        """The summary, plus the run's model and whether it has a chat template (the dashboard's chat switch)."""
        return {**super().describe(), "model": self.scenario.model,
                "chat_template": self.loaded.tokenizer.chat_template is not None}

    def abort_request(self, request_id: str) -> None:
        self.call(lambda: self.sim.engine.abort(request_id, "the client went away"))
