"""A real engine served: a scenario's (ServedScenario, below) or the OpenAI API's (api_run.py).

The engine lives on the run's worker thread: live requests, aborts and the engine's answers all
pass through it (live_requests.py holds the API calls waiting on them). The routes read the model
through `loaded` and `max_model_len`, never through the engine, which only the worker touches; what
the server decides by (admission's waiting count, the shutdown's aborts, the /metrics gauges) is the
engine's own count, `Engine.stats`, a snapshot it replaces whole and any thread may read: never the
reducer's, whose events may be off (--api-events off has no iteration events to say what runs).

What an engine holds outside this process (a tensor-parallel engine's other ranks: processes, the
store's port, gloo's sockets and threads) is let go as soon as the run no longer needs it: when a
scenario run finishes (a finished tensor-parallel run then refuses live requests with RunClosed, a
409, instead of starting its ranks again for one request), when it fails (from whichever thread
fails it: a stalled worker's ranks are killed, which ends the step it is stuck in), and when the
server forgets it (its worker ends). A run on one process keeps its engine: finished, it wakes for a
live request.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.request_output import RequestOutput
from kvscope.backend.events.bus import EventBus, Level
from kvscope.backend.model.weights import WeightCache
from kvscope.backend.run import ScenarioRun
from kvscope.backend.scenario import Scenario
from kvscope.backend.server.live_requests import Listener, LiveRequests
from kvscope.backend.server.run_errors import RunBusy, RunClosed, RunFailed
from kvscope.backend.server.run_pacing import DEFAULT_SPEED
from kvscope.backend.server.runs import Retention, ServedRun

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


class EngineRun(ServedRun):
    """An engine served: its live requests, the engine's answers to the calls waiting on them, aborts.

    A subclass builds its engine on `self.bus` (subscribed first, so that the engine's header is the
    run's first event) and hands it to `serve`."""

    records_controls = True
    engine: Engine  # the real engine, touched on the worker thread only (its `stats` and `close` excepted)
    model: str  # the model's name, as the run was asked for it
    released: str | None = None  # why the engine was closed while the run is held (it takes no request then)

    def __init__(self, run_id: str, events: Level, speed: float, paused: bool, retention: Retention, lesson: bool,
                 forgets_finished: bool) -> None:
        super().__init__(run_id, speed, paused, retention, lesson)
        self.bus = EventBus(level=events)
        self.bus.subscribe(self.publish)
        self.requests = LiveRequests(self.run_id, retention.max_waiting, forgets_finished)
        self.grammar_cache_bytes = retention.grammar_cache_bytes

    def serve(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model
        # Compiled grammars, bounded in bytes: any thread may compile into it (grammar_compiles.py), so the
        # routes hand the worker a grammar ready to run.
        self.grammars = engine.grammars
        if self.grammar_cache_bytes is not None:
            self.grammars.max_bytes = self.grammar_cache_bytes
        self.loaded = engine.loaded  # read-only for the routes: the tokenizer, the model's config and folder
        self.max_model_len = engine.config.max_model_len
        self.dist_rows = DistRows()  # whole raw rows of recent tokens, for the what-if (GET .../dist)
        engine.keep_rows(self.dist_rows)
        engine.stream_outputs(self._deliver)

    def _deliver(self, output: RequestOutput) -> None:
        """The engine's answer for one request (worker thread), to the API call waiting for it."""
        if self.failure is None:  # else a stalled worker that came back: its callers were told RunFailed
            self.requests.deliver(output)

    def _record_control(self, action: str, value: Any) -> None:
        self.bus.emit("control", action=action, value=value)

    def _emit_error(self, message: str, fatal: bool) -> None:
        self.bus.emit("error", message=message, fatal=fatal)

    def _answer_waiting(self, failed: RunFailed) -> None:
        self.requests.fail_all(failed)

    def release(self) -> None:
        self.engine.close()  # a tensor-parallel engine's other ranks stop

    def fail(self, cause: str, error: BaseException | None = None) -> None:
        """Fail the run, then let its ranks go now, whatever the worker is doing: Engine.close from another
        thread than the worker's, during a step, kills the ranks (the step stuck on them fails) and leaves the
        rest to the worker's own release (tp_runner.TensorParallelRunner.close)."""
        super().fail(cause, error)
        self.engine.close()

    def _release_when_finished(self) -> None:
        """On the worker thread, as a scenario run finishes: a tensor-parallel engine's ranks go now, not when
        the server forgets the run (minutes later, or never on an idle server)."""
        if self.engine.config.tensor_parallel > 1:
            self.engine.close()
            self.released = ("it finished, and its tensor-parallel ranks were stopped as it did; start a new run "
                             "for more requests")

    def abort_in_flight(self, reason: str) -> None:
        engine = self.engine
        self.worker.submit(lambda: engine.abort_all(reason))

    def check_room(self, count: int = 1) -> None:
        """RunBusy if the waiting queue cannot take `count` more requests."""
        with self.lock:
            self.requests.check_room(self.engine.stats.num_waiting, count)

    def add_request(self, prompt: str | list[int], max_tokens: int, sampling: dict | None,
                    listener: Listener | None = None, request_id: str | None = None,
                    grammar: CompiledGrammar | None = None) -> str:
        """Add a request live (validated on the worker thread; RequestError if refused, RunBusy if the
        waiting queue is full). It arrives now, on this thread: its TTFT and queue time include the wait
        for the worker to finish the step under way, as a client sees them (and vLLM counts them).
        `grammar`: its structured output, compiled off the worker (grammar_compiles.py)."""
        self._check_open()
        arrival = self.engine.clock()
        with self.lock:
            self.requests.check_room(self.engine.stats.num_waiting, 1)
            self.requests.adds_pending += 1
        try:
            return self.call(lambda: self._add_on_worker(prompt, max_tokens, sampling, listener, request_id, arrival,
                                                         grammar))
        except TimeoutError:
            raise RunBusy(f"run {self.run_id!r} did not take the request in time; try again shortly") from None

    def _add_on_worker(self, prompt: str | list[int], max_tokens: int, sampling: dict | None,
                       listener: Listener | None, request_id: str | None, arrival: float,
                       grammar: CompiledGrammar | None) -> str:
        try:
            self._check_open()  # again on the worker, which alone closes the engine: the run may have finished since
            rid = self.requests.listen(request_id, listener)
            try:
                self.engine.add_request(rid, prompt, max_tokens, sampling, arrival, grammar)
            except Exception:
                self.requests.drop(rid)
                raise
        finally:  # after the add: a room check in between counts the request once at least, never not at all
            with self.lock:
                self.requests.adds_pending -= 1
        self.finished = False  # a finished run wakes up for a live request
        return rid

    def _check_open(self) -> None:
        if self.released is not None:
            raise RunClosed(self.run_id, "finished", self.released)

    def describe(self) -> dict:
        """The summary, plus the run's model and whether it has a chat template (the dashboard's chat switch)."""
        return {**super().describe(), "model": self.model,
                "chat_template": self.loaded.tokenizer.chat_template is not None}

    def abort_request(self, request_id: str) -> None:
        self.call(lambda: self.engine.abort(request_id, "the client went away"))


class ServedScenario(EngineRun):
    """A scenario on a real engine: its requests arrive at their steps (backend/run.py), live ones whenever
    they are sent; it finishes when all are done."""

    kind = "scenario"

    def __init__(self, scenario: Scenario, speed: float = DEFAULT_SPEED, paused: bool = False,
                 run_id: str | None = None, retention: Retention = Retention(), lesson: bool = False,
                 weights: WeightCache | None = None) -> None:
        super().__init__(run_id or uuid.uuid4().hex[:12], scenario.engine.events, speed, paused, retention, lesson,
                         forgets_finished=False)
        self.scenario = scenario
        # The engine, fed the scenario's requests at their arrival steps; the weights are the server's shared copies.
        self.scenario_run = ScenarioRun(scenario, self.bus, weights=weights)
        self.serve(self.scenario_run.engine, scenario.model)

    def has_work(self) -> bool:
        return not self.scenario_run.done

    def _advance(self) -> None:
        self.scenario_run.step()
        if self.scenario_run.done and not self.finished:
            self.finished = True
            self.scenario_run.finish()
            self._release_when_finished()
