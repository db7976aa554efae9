"""Roofline: each iteration's arithmetic intensity against the FLOP/s it attains on the chosen hardware."""

from __future__ import annotations

from typing import Any

from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.frontend.hardware import HardwareChoice, ModelledRun
from kvscope.frontend.palette import PHASE_COLORS
from kvscope.frontend.views.base import FeedView, legend, view_card
from kvscope.frontend.views.charts import make_chart
from kvscope.frontend.views.chunks import Chunks
from kvscope.frontend.views.live_text import LiveText
from kvscope.backend.perf.model_run import ModelledStep
from kvscope.backend.phase import SHOWN_PHASES

EXPLANATION = """
A **roofline** says how fast a piece of work can run on a machine from one number: its
**arithmetic intensity**, the FLOPs it does per byte it moves to or from memory (x, log scale).
Below the **ridge** (where the two roofs meet) memory bandwidth limits it: the slanted roof,
bandwidth × intensity. Above it the compute units do: the flat roof, peak FLOP/s.

One point per iteration, priced on the hardware picked above the views by kvscope's cost model
(docs/perf_model.md): its FLOPs over its modelled time (y, log scale), coloured by the phase of
most of its tokens. A **decode** step reads every weight to produce one token per sequence, so its
intensity is about the batch size: far left, **memory-bound**; batching more sequences moves it
right. A **prefill** chunk multiplies each weight by many tokens and climbs towards the compute
roof. Points sit below the roofs because an iteration is several op groups that each wait for one
roof (and the all-reduces with tp > 1), plus the third limit: a **fixed cost** per step, the
dispatch of its ops, kernel launches and the engine's Python, which no byte or FLOP explains. The
dashed line is the roofs lowered by it: the fastest a step of the run's size can go while it pays
that cost. For a small model at batch 1 it is most of the step; batching spreads it over more
tokens, and capturing the step (`engine.compile_decode` on a CPU, CUDA graphs on a GPU) shrinks it.
The times are modelled (lower bounds: real kernels reach 60-90% of the roofs, and a GPU's fixed
cost is assumed, one CUDA-graph replay), whatever machine recorded the run. On **this-machine**,
for a run that ran here, each point is the step as the engine **measured** it, set against this
machine's measured roofs (its linear layers stream weights below the bandwidth roof; the caption
says how fast): what the step took beyond its roofs is its fixed cost, measured. Hover a point for
its split: compute, memory, fixed cost.
"""

FIXED_COLOR = "#b45309"
LEGEND = [(PHASE_COLORS[p], p) for p in SHOWN_PHASES] + [("#111827", "roofs: bandwidth × intensity, peak FLOP/s"),
                                                         (FIXED_COLOR, "roofs lowered by the fixed cost per step")]
ROOF_COLOR = "#111827"
OTHER_COLOR = "#6b7280"  # the other run of a side-by-side comparison
FIXED_SAMPLES = 32  # points along the dashed curve (log-spaced intensities)


def roofline_point(s: ModelledStep) -> list[Any]:
    """[intensity (FLOP/B), attained FLOP/s, step, µs, roofs' µs, compute µs, memory µs, fixed µs, measured]:
    one iteration's point and its split (the tooltip's)."""
    return [s.intensity, s.attained_flops, s.step, *(round(t * 1e6, 2) for t in (s.time_s, s.roof_s, s.compute_s,
                                                                                 s.memory_s, s.fixed_s)), s.measured]


def fixed_cost_line(peak_flops: float, bandwidth: float, step_bytes: float, fixed_s: float, lo: float,
                    hi: float) -> list[list[float]]:
    """The roofs lowered by a fixed cost: a step moving `step_bytes` at intensity x does x × step_bytes FLOPs in
    at least max(FLOPs / peak, bytes / bandwidth) + fixed_s seconds. Log-spaced over [lo, hi] (the roofs' span)."""
    if step_bytes <= 0 or fixed_s <= 0:
        return []
    ridge = peak_flops / bandwidth
    lo, hi = min(lo, ridge / 4), max(hi, ridge * 4)
    xs = [lo * (hi / lo) ** (i / (FIXED_SAMPLES - 1)) for i in range(FIXED_SAMPLES)]
    return [[x, x * step_bytes / (max(x * step_bytes / peak_flops, step_bytes / bandwidth) + fixed_s)] for x in xs]


def typical_step(run: ModelledRun) -> ModelledStep | None:
    """The run's median decode step by fixed cost (its median step of any phase if none decoded): the step
    whose size and fixed cost the dashed line and the caption quote."""
    steps = [s for s in run.roofline_steps.values() if s.phase == "decode"] or list(run.roofline_steps.values())
    return sorted(steps, key=lambda s: s.fixed_s)[len(steps) // 2] if steps else None


def fixed_caption(run: ModelledRun) -> str:
    s = typical_step(run)
    if s is None:
        return ""
    how = "measured: the engine's clock" if s.measured else "modelled: the profile's overhead"
    return (f" · fixed cost {s.fixed_s * 1e3:,.3g} ms per {s.phase} step ({how}; the step took "
            f"{s.time_s * 1e3:,.3g} ms, its roofs allow {s.roof_s * 1e3:,.3g} ms)")


def roof_line(peak_flops: float, bandwidth: float, lo: float, hi: float) -> list[list[float]]:
    """The two roofs over intensities [lo, hi]: bandwidth × x up to the ridge, then the peak."""
    ridge = peak_flops / bandwidth
    lo, hi = min(lo, ridge / 4), max(hi, ridge * 4)
    return [[lo, bandwidth * lo], [ridge, peak_flops], [hi, peak_flops]]


def caption(run: ModelledRun | None, label: str, problem: str | None) -> str:
    if run is None:
        return problem or ""
    hw, dtype = run.dep.hardware, run.dep.dtype
    one, several = hw.weight_bandwidth(1), hw.weight_bandwidth(2)
    stream = (f" (weights stream at {one / 1e9:,.1f} GB/s over one token, {several / 1e9:,.1f} over several)"
              if min(one, several) < hw.mem_bandwidth else "")
    return (f"{label}: peak {hw.peak_flops(dtype) / 1e12:,.1f} TFLOP/s ({dtype}), "
            f"{hw.mem_bandwidth / 1e9:,.0f} GB/s{stream}, ridge {hw.ridge(dtype):,.0f} FLOP/B · "
            f"{len(run.roofline_steps)} iterations · model sizes: {run.source}{fixed_caption(run)}")


class RooflineView(FeedView):
    name = "roofline"

    def __init__(self, feed: RunFeed, hardware: HardwareChoice, height: str = "300px") -> None:
        self.hardware = hardware
        self.chunks = {phase: Chunks(f"rl-{phase}-") for phase in SHOWN_PHASES}
        self.last_step = -(10**9)
        self.roof_sent: tuple[list, list] = ([], [])
        self.span = (1.0, 1.0)  # the intensities drawn so far (the roofs span them)
        self.points: list[list[Any]] = []  # every point drawn, in step order (side by side: the other column's)
        self.other_note = ""  # side by side: what the hollow points are
        self.other_series: dict | None = None  # side by side: the other run's points (redrawn by `full`)
        with view_card("Roofline on the chosen hardware", EXPLANATION, "w-full"):
            legend(LEGEND)
            self.caption = LiveText().classes("kv-caption").mark("roofline-caption").props("data-kv=roofline-caption")
            self.chart = make_chart(self._options(), height, "roofline")
        hardware.on_change(self.invalidate)
        super().__init__(feed)

    def _options(self) -> dict:
        return {
            "grid": {"left": 64, "right": 24, "top": 30, "bottom": 44},
            "tooltip": {"trigger": "item", "confine": True, ":formatter": "kvscope.rooflineTip"},
            "xAxis": {"type": "log", "name": "FLOP per byte", "nameLocation": "middle", "nameGap": 24,
                      "axisLabel": {":formatter": "kvscope.si"}},
            "yAxis": {"type": "log", "name": "FLOP/s", "axisLabel": {":formatter": "kvscope.si"}},
            "series": [],
        }

    def full(self) -> bool:
        run = self.hardware.modelled()
        self.caption.set(caption(run, self.hardware.label, self.hardware.problem()) + self.other_note)
        for chunks in self.chunks.values():
            chunks.clear()
        self.last_step, self.roof_sent, self.span, self.points = -(10**9), ([], []), (1.0, 1.0), []
        if run is not None:
            self._new_points(run)
        series = [self._points(phase, sid, data) for phase, chunks in self.chunks.items() for sid, data in chunks.all()]
        if self.other_series is not None:
            self._widen(self.other_series["data"])
            series.append(self.other_series)
        series += self._roofs(run, force=True)
        self.push(self.chart, {"series": series}, replace_series=True)
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        if not any(e.event["type"] == "iteration" for e in entries):
            return False
        run = self.hardware.modelled()
        if run is None:
            return False
        self._new_points(run)
        series = [self._points(phase, sid, data) for phase, chunks in self.chunks.items()
                  for sid, data in chunks.take_dirty()]
        series += self._roofs(run)
        if not series:
            return False
        self.caption.set(caption(run, self.hardware.label, None) + self.other_note)
        self.push(self.chart, {"series": series})
        return True

    def _new_points(self, run: ModelledRun) -> None:
        lo, hi = self.span
        shown = run.roofline_steps
        for step in sorted(s for s in shown if s > self.last_step):
            priced = shown[step]
            self.chunks[priced.phase].add(step, roofline_point(priced))
            self.points.append(roofline_point(priced))
            lo, hi = min(lo, priced.intensity), max(hi, priced.intensity)
            self.last_step = step
        self.span = (lo, hi)

    def show_other(self, points: list[list[Any]], title: str, hardware: str) -> None:
        """Side by side: the other run's points, hollow and grey, on this chart, so that both runs sit
        against one pair of roofs (each priced on its own column's hardware, which the note names)."""
        self._widen(points)
        self.other_note = f" · hollow ◇: {title}, priced on {hardware}" if points else ""
        self.other_series = {"id": "other-run", "name": title, "type": "scatter", "data": points,
                             "symbol": "emptyDiamond", "symbolSize": 8, "z": 1,
                             "itemStyle": {"color": OTHER_COLOR, "opacity": 0.9}}
        run = self.hardware.modelled()
        roofs = self._roofs(run) if run is not None else []
        if run is not None:
            self.caption.set(caption(run, self.hardware.label, None) + self.other_note)
        self.push(self.chart, {"series": [self.other_series, *roofs]})

    def _widen(self, points: list[list[Any]]) -> None:
        """The roofs span these intensities too."""
        lo, hi = self.span
        for intensity, *_ in points:
            lo, hi = min(lo, intensity), max(hi, intensity)
        self.span = (lo, hi)

    def _points(self, phase: str, sid: str, data: list) -> dict:
        return {"id": sid, "name": phase, "type": "scatter", "data": data, "symbolSize": 7,
                "itemStyle": {"color": PHASE_COLORS[phase], "opacity": 0.8}}

    def _roofs(self, run: ModelledRun | None, force: bool = False) -> list[dict]:
        """The roofs and the dashed roofs-with-fixed-cost, when they moved (or `force`)."""
        line: list[list[float]] = []
        fixed: list[list[float]] = []
        if run is not None:
            hw, dtype = run.dep.hardware, run.dep.dtype
            line = roof_line(hw.peak_flops(dtype), hw.mem_bandwidth, *self.span)
            typical = typical_step(run)
            if typical is not None:
                fixed = fixed_cost_line(hw.peak_flops(dtype), hw.mem_bandwidth, typical.bytes, typical.fixed_s,
                                        *self.span)
        if not force and (line, fixed) == self.roof_sent:
            return []
        self.roof_sent = (line, fixed)
        return [{"id": "roof", "type": "line", "data": line, "showSymbol": False, "silent": True,
                 "lineStyle": {"color": ROOF_COLOR, "width": 2}, "itemStyle": {"color": ROOF_COLOR}},
                {"id": "fixed-roof", "type": "line", "data": fixed, "showSymbol": False, "silent": True,
                 "lineStyle": {"color": FIXED_COLOR, "width": 2, "type": "dashed"},
                 "itemStyle": {"color": FIXED_COLOR}}]
