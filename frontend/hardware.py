"""The hardware one run column is modelled on, and the run's iterations priced there.

The picker offers backend/perf's profiles (HARDWARE_NAMES) and tensor-parallel degrees; the
timeline's modelled axis, the roofline chart and the metrics' modelled latencies all read the same
`ModelledRun`, computed once per (hardware, tp) and extended as iterations arrive. `this-machine`
is measured (about 4 s) the first time: in a thread, so that the page's event loop keeps running;
later choices read the cached figures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nicegui import ui

from kvscope.backend.events.history import Column, RunHistory
from kvscope.backend.events.state import RunState
from kvscope.backend.perf.cost_model import TP_DEGREES, Deployment
from kvscope.backend.perf.errors import PerfError
from kvscope.backend.perf.hardware import HARDWARE_NAMES, THIS_MACHINE, HardwareProfile, get_hardware, profile_from
from kvscope.backend.perf.machine_cache import read_cache
from kvscope.backend.perf.model_run import (ModelledLatency, ModelledStep, RequestSteps, as_measured, model_step,
                                            modelled_latency, run_deployment)
from kvscope.frontend.client import RunFeed

DEFAULT_HARDWARE = "h100"


class ModelledRun:
    """A run's iterations priced on one deployment, extended as the run's history grows.

    `measured`: the run ran on this machine's kind of device with this tp, and the deployment is
    this machine's measured roofs: the roofline draws each step at the time the engine measured, and
    what it took beyond its roofs is its fixed cost (model_run.as_measured). The timeline's modelled
    axis and the modelled latencies stay modelled."""

    def __init__(self, dep: Deployment, source: str, measured: bool = False) -> None:
        self.dep = dep
        self.source = source  # where the model's sizes came from
        self.measured = measured
        self.steps: dict[int, ModelledStep] = {}  # iterations that ran something
        self.as_ran: dict[int, ModelledStep] = {}  # measured: the same steps at the engine's own times
        self.ends: dict[int, float] = {}  # step -> modelled seconds up to its end
        self.total_s = 0.0
        self.last_step = -(10**9)

    def extend(self, columns: list[Column]) -> None:
        """Price the columns newer than the last one priced."""
        new = []
        for col in reversed(columns):  # the new ones are at the end: stop at the first known
            if col.step <= self.last_step:
                break
            new.append(col)
        for col in reversed(new):
            rows = [(c.kind, c.tokens, c.context_len) for c in col.scheduled]
            if rows:
                priced = self.steps[col.step] = model_step(self.dep, col.step, rows)
                if self.measured:
                    self.as_ran[col.step] = as_measured(priced, col.duration_s)
                self.total_s += priced.time_s
            self.ends[col.step] = self.total_s
            self.last_step = col.step

    @property
    def roofline_steps(self) -> dict[int, ModelledStep]:
        """The steps the roofline draws: as they ran where measured, else as priced."""
        return self.as_ran if self.measured else self.steps

    def latency(self, state: RunState, history: RunHistory) -> ModelledLatency:
        """The run's mean TTFT, TPOT and tokens/s with its iterations priced here."""
        tokens = sum(history.tokens_at.get(step, 0) for step in self.steps)  # on record: none after a snapshot
        known_from = history.columns[0].step if history.columns else 0
        return modelled_latency(list(self.steps.values()), request_steps(state), tokens, known_from)

    def clock(self, col: Column) -> tuple[float, float]:
        """(modelled seconds at the column's end, its modelled duration), as the timeline places it."""
        priced = self.steps.get(col.step)
        return self.ends[col.step], priced.time_s if priced else 0.0


class HardwareChoice:
    """One column's hardware and tp; listeners hear of a change (the views redraw)."""

    def __init__(self, feed: RunFeed) -> None:
        self.feed = feed
        self.name = DEFAULT_HARDWARE
        self.tp = 1
        self.profile: HardwareProfile | None = get_hardware(DEFAULT_HARDWARE)
        self.measuring = False  # this-machine's calibration is running in its thread
        self.listeners: list[Callable[[], None]] = []
        self._runs: dict[tuple[str, int], ModelledRun | str] = {}  # a priced run, or why it cannot be
        self._epoch = -1

    def on_change(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    @property
    def label(self) -> str:
        """The hardware as the page names it: the profile's label, and the GPU count above one."""
        name = self.profile.label if self.profile is not None else self.name
        return f"{self.tp} × {name}" if self.tp > 1 else name

    async def choose(self, name: str, tp: int) -> None:
        """Model the run on `name` over `tp` GPUs (this-machine: measured in a thread the first time)."""
        self.name, self.tp = name, tp
        if name == THIS_MACHINE:
            figures = read_cache()
            if figures is None:
                self.measuring, self.profile = True, None
                self._notify()
                # get_hardware measures, importing torch: the dashboard loads it only for this
                self.profile = await asyncio.to_thread(get_hardware, name)
                self.measuring = False
            else:
                self.profile = profile_from(figures)
        else:
            self.profile = get_hardware(name)
        self._notify()

    def modelled(self) -> ModelledRun | None:
        """The run priced on the chosen hardware up to its latest iteration; None: see `problem()`."""
        run = self._run()
        if isinstance(run, ModelledRun):
            run.extend(self.feed.history.columns)
            return run
        return None

    def problem(self) -> str | None:
        """Why the run cannot be modelled now (measuring, no header yet, a size or tp it refuses)."""
        if self.measuring:
            return "measuring this machine (about 4 s)…"
        run = self._run()
        return run if isinstance(run, str) else None

    def _run(self) -> ModelledRun | str:
        state = self.feed.state
        if self.profile is None or state is None or not state.model:
            return "waiting for the run's header"
        if self.feed.epoch != self._epoch:  # a resync: a new record, perhaps other iterations
            self._runs.clear()
            self._epoch = self.feed.epoch
        key = (self.profile.name, self.tp)
        if key not in self._runs:
            try:
                dep, shaped = run_deployment(run_header(state), self.profile, self.tp)
                ran_here = (self.profile.measures(state.device) and not state.simulated
                            and self.tp == int(state.config.get("tensor_parallel") or 1))
                self._runs[key] = ModelledRun(dep, shaped.source, ran_here)
            except PerfError as e:
                self._runs[key] = f"cannot model this run: {e}"
        return self._runs[key]

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()


def run_header(state: RunState) -> dict:
    """The parts of the run's header the cost model reads, as the reducer keeps them."""
    return {"model": state.model, "config": state.config, "weights": state.weights}


def request_steps(state: RunState) -> list[RequestSteps]:
    """Every request's first iteration, first-token and finish steps and output length (the best sequence's).

    An arrival event's step is the iteration before the arrival (-1 for requests there at the start),
    so the first iteration that can serve a request is the next one. A request first seen running
    (a trace that starts mid-run) has no arrival on record and is left out."""
    return [RequestSteps(r.arrival_step + 1, r.first_token_step, r.finish_step, len(r.output_token_ids))
            for r in state.requests.values() if not r.joined]


class HardwarePicker:
    """The hardware and tp selects of a run column."""

    def __init__(self, choice: HardwareChoice) -> None:
        self.choice = choice
        self.hardware = ui.select(HARDWARE_NAMES, value=choice.name, label="hardware",
                                  on_change=self._on_change).classes("w-28").style("flex-shrink: 0").props("dense data-kv=hardware-picker").mark("hardware-picker")
        self.tp = ui.select(list(TP_DEGREES), value=choice.tp, label="tp",
                            on_change=self._on_change).classes("w-16").style("flex-shrink: 0").props("dense").mark("hardware-tp")
        self.hardware.tooltip("the hardware the roofline chart, the timeline's modelled axis and the "
                              "modelled latencies price this run on")
        self.tp.tooltip("tensor parallelism: GPUs sharing each layer")

    async def _on_change(self) -> None:
        name, tp = self.hardware.value, int(self.tp.value or 1)
        if (name, tp) == (self.choice.name, self.choice.tp):
            return
        if name == THIS_MACHINE and read_cache() is None:
            ui.notify("Measuring this machine (about 4 s): matmul FLOP/s and memory bandwidth")
        await self.choice.choose(name, tp)
        problem = self.choice.problem()
        if problem is not None:
            ui.notify(problem, type="warning")
