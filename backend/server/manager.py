"""The runs a server holds: start them from scenarios or traces, find them, and the API's own run."""

from __future__ import annotations

import json
import threading
from typing import Any

from backend.config import EngineConfig
from backend.scenario import Scenario, apply_overrides, load_scenario, validate
from backend.server.replay import ReplayRun
from backend.server.runs import DEFAULT_SPEED, EngineRun, RunError, ServedRun, build_run

MAX_RUNS = 16  # finished runs beyond this are forgotten, oldest first
API_RUN_ID = "api"


class RunManager:
    def __init__(self, default_model: str = "demo", watcher_queue_limit: int | None = None) -> None:
        self.default_model = default_model
        self.watcher_queue_limit = watcher_queue_limit
        self.runs: dict[str, ServedRun] = {}
        self._lock = threading.Lock()

    def get(self, run_id: str) -> ServedRun | None:
        return self.runs.get(run_id)

    def start_scenario(self, scenario: str | dict[str, Any], overrides: dict[str, Any] | None = None,
                       speed: float = DEFAULT_SPEED, paused: bool = False) -> ServedRun:
        resolved = self.resolve(scenario, overrides)
        return self._add(build_run(lambda: EngineRun(resolved, speed, paused)))

    def start_replay(self, events: list[dict], speed: float = DEFAULT_SPEED, paused: bool = False) -> ServedRun:
        return self._add(build_run(lambda: ReplayRun(events, speed, paused)))

    def api_run(self) -> EngineRun:
        """The open-ended run that OpenAI-compatible requests join (created on first use)."""
        with self._lock:
            run = self.runs.get(API_RUN_ID)
            if run is None:
                # No requests of its own, which a scenario file may not have: built, not validated.
                engine = EngineConfig(num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=512)
                scenario = Scenario.model_construct(name="api", description="Requests from the OpenAI API.",
                                                    lesson="", model=self.default_model, seed=0, engine=engine,
                                                    requests=[], generate=None)
                run = EngineRun(scenario, speed=0.0, run_id=API_RUN_ID, open_ended=True).start()
                self.runs[API_RUN_ID] = run
            assert isinstance(run, EngineRun)
            return run

    def resolve(self, scenario: str | dict[str, Any], overrides: dict[str, Any] | None) -> Scenario:
        """A scenario name or inline object, with dotted overrides applied, validated."""
        if isinstance(scenario, str):
            base = load_scenario(scenario).model_dump(mode="json")
            source = f"scenario {scenario}"
        else:
            base, source = dict(scenario), "scenario"
        items = [(key, value, f"overrides {key}={json.dumps(value)}") for key, value in (overrides or {}).items()]
        return validate(base, source, apply_overrides(base, items))

    def _add(self, run: ServedRun) -> ServedRun:
        with self._lock:
            finished = [rid for rid, r in self.runs.items() if r.finished and rid != API_RUN_ID]
            while len(self.runs) >= MAX_RUNS and finished:
                self.runs.pop(finished.pop(0)).stop()
            if len(self.runs) >= MAX_RUNS:
                raise RunError(f"too many runs at once (at most {MAX_RUNS}); let one finish first")
            self.runs[run.run_id] = run
        if self.watcher_queue_limit:
            run.queue_limit = self.watcher_queue_limit
        return run.start()

    def stop_all(self) -> None:
        for run in self.runs.values():
            run.stop()

