"""A scenario run: an engine fed its requests at their arrival steps, stepped until all are done.

Headless (`kvscope run`, the tests, the benchmarks) and served runs (which add pacing and a
thread around it) share this one loop.
"""

from __future__ import annotations

import statistics
from collections import deque

from dataclasses import replace

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.disaggregated import build_engine
from kvscope.backend.engine.engine import Runtime
from kvscope.backend.engine.request import RequestError
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel, WeightsMode
from kvscope.backend.model.weights import WeightCache
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.simulate import ShapeOnlyModel, simulated_sampling, simulation
from kvscope.backend.scenario import PlannedRequest, Scenario, ScenarioError, check_available, plan_requests

WEIGHTS = WeightCache()  # the process's weight copies: headless runs, and a server's unless it brings its own


def cached_model(name: str, weights: WeightsMode = "native") -> LoadedModel:
    """Models are read-only at inference, so runs in one process share them."""
    return WEIGHTS.model(name, weights)


class ScenarioRun:
    def __init__(self, scenario: Scenario, bus: EventBus | None = None, loaded: LoadedModel | None = None,
                 weights: WeightCache | None = None) -> None:
        """`loaded`: run this model (built by the caller, never shared); else the scenario's model, its
        quantized copy and its draft model come from `weights` (default: the process's WEIGHTS), shared
        with every other run of the same model and settings."""
        self.scenario = scenario
        shared = None if loaded is not None else weights or WEIGHTS  # a caller's own model shares nothing
        if scenario.simulate is not None:  # a shape on a GPU type: no weights, modelled time
            self.loaded, config, runtime = simulated(scenario)
            bus = bus or EventBus(level=config.events)
            bus.use_clock(runtime.clock)
        else:
            check_available(scenario)
            self.loaded, config, runtime = (shared.model(scenario.model, scenario.engine.weights) if shared else loaded,
                                            scenario.engine, None)
        self.engine = build_engine(self.loaded, config, bus, seed=scenario.seed, runtime=runtime, shared=shared)
        self.bus = self.engine.bus
        planned = plan_requests(scenario, self.loaded)
        if runtime is not None:
            planned = [replace(p, sampling=simulated_sampling(p.sampling)) for p in planned]
        self.pending: deque[PlannedRequest] = deque(planned)
        self.total = len(self.pending)
        self.rejected: dict[str, str] = {}
        self.engine.emit_header(scenario.model_dump(mode="json"), self.loaded.name if runtime else scenario.model)
        # A bound on iterations so that no bug can loop forever (a prompt's characters bound its tokens).
        self.max_steps = 64 + sum(4 * (len(p.prompt) + p.max_tokens) for p in self.pending) + \
            (self.pending[-1].arrival_step if self.pending else 0)
        # Requests due at the first step arrive now: a run that waits before it (a lesson's start, a page
        # opening it paused) shows its queue, and a lesson can ask about those requests there.
        self._deliver_due()

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished()

    def step(self) -> None:
        """Deliver the requests due now, then run one engine iteration."""
        self._deliver_due()
        self.engine.step()

    def _deliver_due(self) -> None:
        while self.pending and self.pending[0].arrival_step <= self.engine.step_no:
            p = self.pending.popleft()
            try:
                self.engine.add_request(p.request_id, p.prompt, p.max_tokens, p.sampling)
            except RequestError as e:
                self.rejected[p.request_id] = str(e)

    def run(self, on_step=None) -> dict:
        """Step to the end; returns the summary. on_step(run) is called after every iteration."""
        while not self.done and self.engine.step_no < self.max_steps:
            self.step()
            if on_step:
                on_step(self)
        self.finish()
        return self.summary()

    def finish(self) -> None:
        """Emit the run's one run_finished event (headless runs and served runs both end here)."""
        self.bus.emit("run_finished", num_steps=self.engine.step_no, reason="completed" if self.done else "step_limit")

    @property
    def num_finished(self) -> int:
        return sum(r.finish_reason is not None for r in self.engine.requests.values()) + len(self.rejected)

    def summary(self) -> dict:
        """The numbers of the final table and of --report."""
        reqs = list(self.engine.requests.values())
        done = [r for r in reqs if r.finish_reason and r.finish_reason != "abort"]
        m = self.engine.metrics
        elapsed = (m.last - m.start) if m.start is not None and m.last is not None else 0.0
        usage, waste = m.mean_kv()
        return {
            "scenario": self.scenario.name,
            "steps": self.engine.step_no,
            "requests": len(reqs) + len(self.rejected),
            "finished": len(done),
            "aborted": sum(r.finish_reason == "abort" for r in reqs),
            "rejected": len(self.rejected),
            "output_tokens": m.total_output_tokens,
            "prefill_tokens_computed": m.total_prefill_tokens,
            "tokens_per_s": m.total_output_tokens / elapsed if elapsed > 0 else 0.0,
            "ttft_s": _stats([r.times.ttft() for r in done]),
            "tpot_s": _stats([r.times.tpot() for r in done]),
            "e2e_s": _stats([r.times.e2e() for r in done]),
            "kv_usage_mean": usage,
            "kv_waste_mean": waste,
            "prefix_hit_rate": self.engine.prefix_hit_rate,
            "num_preemptions": self.engine.num_preemptions,
            "peak_kv_blocks_saved_by_sharing": m.peak_blocks_saved_by_sharing,
            "speculative": self.engine.spec_stats.summary() if self.engine.config.speculative else None,
            "per_request": {r.request_id: {"finish_reason": r.finish_reason, "prompt_tokens": len(r.prompt_ids),
                                           "output_tokens": len(r.seq.output_token_ids), "ttft_s": r.times.ttft(),
                                           "e2e_s": r.times.e2e(), "output_text": r.output_text}
                            for r in reqs},
            "rejections": self.rejected,
            "simulated": self.engine.runtime.header.get("simulated"),
        }


def simulated(scenario: Scenario) -> tuple[ShapeOnlyModel, EngineConfig, Runtime]:
    """The scenario's simulate section as a shape-only model, its engine config and runtime."""
    spec = scenario.simulate
    try:
        return simulation(spec.model_shape, spec.hardware, spec.tp, spec.link, spec.gpu_memory_utilization,
                          scenario.engine, scenario.seed)
    except PerfError as e:
        field = e.field if e.field.startswith(("engine", "simulate")) else f"simulate.{e.field}"
        raise ScenarioError(field, e.reason) from None


def _stats(values: list[float | None]) -> dict:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"mean": None, "p50": None, "p95": None}
    return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p95": xs[min(len(xs) - 1, int(0.95 * len(xs)))]}
