"""Metrics over time: throughput, TTFT / TPOT per request, KV usage, waste and prefix hit rate."""

from __future__ import annotations

import statistics


from kvscope.backend.perf.model_run import ModelledLatency
from kvscope.frontend.client import LogEntry, RunFeed
from kvscope.backend.events.history import Finish, MetricPoint
from kvscope.frontend.hardware import HardwareChoice
from kvscope.frontend.views.base import FeedView, view_card
from kvscope.frontend.views.block_pool import blocks_in_use
from kvscope.frontend.views.charts import make_chart
from kvscope.frontend.views.live_text import LiveText
from kvscope.frontend.views.chunks import Chunks
from kvscope.frontend.views.kv_calc import memory_text

EXPLANATION = """
Times here are **engine time**: the sum of the iterations' own durations (what the model took,
the iteration events' `duration_s`), never the wall clock, which the playback speed stretches
(at 4 iterations a second every iteration would seem to last 250 ms).

- **tokens/s**: output tokens per second of engine time, over the last 16 iterations; once the run
  has finished, over the whole run. A page opened on a run already under way counts only the
  iterations it has seen ("–" until the first): the snapshot it starts from carries no tokens.
- **TTFT** (time to first token): engine time from a request's arrival to the end of the iteration
  that produced its first token: queueing plus prefill. Prefix caching and chunked prefill cut it.
  One dot per finished request.
- **TPOT** (time per output token): engine time from its first token to its last, divided by its
  later tokens: the decode speed a user feels. Bigger batches raise throughput but also TPOT.
- **queue time**: engine time from a request's arrival to the first iteration that ran it.
- **The API's run** (`api`, `api-MODEL`: the OpenAI API's requests) runs unpaced, as clients wait
  on it, so its TTFT, TPOT and queue time are each request's own, on the engine's clock (wall time,
  as a client waits): the very numbers the request_finished events carry and `GET /metrics` reports
  (docs/api.md).
- **KV usage**: the share of the cache's blocks held by sequences (a block counts from its first
  token, so 100% can mean full blocks or many part-filled last blocks). The headline is the blocks
  held now, the block pool's own count; the chart, each iteration's end.
- **KV waste**: token slots in held blocks that are still empty, over all slots (the unfilled tail
  of each last block, or with the contiguous layout the whole reserved maximum length): paging
  keeps it below one block per sequence.
- **prefix hit rate**: prompt tokens found already in the cache instead of being recomputed.
- **blocks saved**: blocks that sharing (forks of n > 1 and beams, prefix hits) saves now: what every
  block table would hold on its own, less the distinct blocks.
- **draft acceptance** (speculative decoding only): drafted tokens the target model accepted.

Once a run has finished, the headline keeps its final figures: usage, waste and hits as they were
at the last iteration that ran something (afterwards every block is free).

**Modelled** (the line under the numbers): the same TTFT, TPOT and tokens/s with every iteration's
time priced on the hardware picked above the views instead of measured (the roofline chart's cost
model): what this run's batches would take there. Lower bounds: the model assumes kernels reach
their roofs. A **simulated** run (no weights ran) says so: its engine time is modelled already.

The line above the chart: the weights' dtype and bytes (quantized against unquantized), the KV
cache's dtype and bytes per token, and the draft model's, when there is one.
"""

# (key, legend name, colour, grid): one line per metric
LINES = [
    ("tokens_per_s", "tokens/s", "#4e79a7", 0),
    ("kv_usage", "KV usage %", "#59a14f", 1),
    ("kv_waste", "KV waste %", "#e15759", 1),
    ("prefix_hit_rate", "prefix hit %", "#b07aa1", 1),
    ("spec_acceptance_rate", "draft acceptance %", "#edc948", 1),  # speculative runs only
]
PERCENT = {"kv_usage", "kv_waste", "prefix_hit_rate", "spec_acceptance_rate"}
KPI_TITLES = {"tps": "tokens/s (engine time)", "ttft": "mean TTFT (engine)", "tpot": "mean TPOT (engine)",
              "queue": "mean queue time (engine)",
              "usage": "KV usage", "waste": "KV waste", "hit": "prefix hits", "saved": "blocks saved by sharing (peak)",
              "preempt": "preemptions", "done": "finished", "spec": "drafts accepted",
              "transfer": "mean KV transfer (in TTFT)"}


# what changes the headline: an iteration's metrics, a finish, and the blocks held (KV usage is the
# pool's count now, which moves inside an iteration too)
HEADLINE_EVENTS = {"metrics", "request_finished", "block_alloc", "block_free", "block_share"}
KV_LINES = {"kv_usage", "kv_waste"}  # not drawn without a KV cache: its scratch blocks hold nothing


def kpi_html(values: dict[str, str], titles: dict[str, str] | None = None) -> str:
    """The current numbers in large type (one HTML string: one message per tick for all of them)."""
    titles = {**KPI_TITLES, **(titles or {})}
    cells = "".join(f'<div class="kv-kpi"><div class="kv-kpi-value">{value}</div>'
                    f'<div class="kv-kpi-label">{titles[key]}</div></div>' for key, value in values.items())
    return f'<div class="kv-kpis">{cells}</div>'


def duration_text(seconds: float | None) -> str:
    """A modelled duration in the unit that reads well (they run from microseconds to seconds)."""
    if seconds is None:
        return "–"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def modelled_text(latency: ModelledLatency, hardware: str, simulated: bool) -> str:
    """One line: TTFT, TPOT and tokens/s modelled on the hardware (and whether the run was simulated)."""
    tps = f"{latency.tokens_per_s:,.0f}" if latency.tokens_per_s is not None else "–"
    prefix = "simulated run (no weights ran; engine time above is modelled) · " if simulated else ""
    return (f"{prefix}modelled on {hardware}: mean TTFT {duration_text(latency.ttft_s)} · "
            f"mean TPOT {duration_text(latency.tpot_s)} · {tps} tokens/s")


def line_value(point: MetricPoint, key: str) -> float | None:
    value = getattr(point, key)
    if value is None:  # a metric this run does not have (no speculative decoding)
        return None
    return round(100 * value, 2) if key in PERCENT else round(value, 1)


SIDE_NAME = {"nameLocation": "middle", "nameGap": 56}  # beside the numbers ("50,000" at 16 px), not on them


class MetricsView(FeedView):
    name = "metrics"

    def __init__(self, feed: RunFeed, hardware: HardwareChoice, height: str = "300px") -> None:
        self.hardware = hardware
        self.lines = {key: Chunks(f"m-{key}-", size=64) for key, *_ in LINES}
        self.last_point: dict[str, list] = {}
        self.n_points = 0
        self.n_finishes = -1
        self.kpis: dict[str, str] = {key: "–" for key in KPI_TITLES if key != "spec"}
        with view_card("Metrics over time", EXPLANATION, "w-full"):
            self.kpi_row = LiveText(kpi_html(self.kpis), html=True).classes("w-full").mark("kpis")
            self.modelled = LiveText().classes("kv-caption").mark("metrics-modelled")
            self.memory = LiveText().classes("kv-caption").mark("metrics-memory")
            self.chart = make_chart(self._options(), height, "metrics")
        hardware.on_change(self._modelled)
        super().__init__(feed)

    def _options(self) -> dict:
        return {
            # one scrolling row, and the axes named along their sides: a wrapped legend or names
            # above the plot ran into each other at 16 px (projector mode)
            "legend": {"top": 0, "type": "scroll", "textStyle": {"fontSize": 11}, "pageTextStyle": {"fontSize": 16}},
            "tooltip": {"trigger": "axis"},
            "grid": [{"left": 76, "right": 76, "top": 34, "bottom": "52%"},
                     {"left": 76, "right": 76, "top": "58%", "bottom": 44}],
            "xAxis": [{"type": "value", "gridIndex": 0, "min": "dataMin", "max": "dataMax",
                       "axisLabel": {"show": False}},
                      {"type": "value", "gridIndex": 1, "min": "dataMin", "max": "dataMax", "name": "iteration",
                       "nameLocation": "middle", "nameGap": 22}],
            "yAxis": [{"type": "value", "gridIndex": 0, "name": "tokens/s", **SIDE_NAME, "splitNumber": 3},
                      {"type": "value", "gridIndex": 0, "name": "ms", "position": "right", **SIDE_NAME,
                       "splitNumber": 3, "splitLine": {"show": False}},
                      {"type": "value", "gridIndex": 1, "name": "%", "min": 0, "max": 100, **SIDE_NAME,
                       "interval": 50}],
            "dataZoom": [{"type": "inside", "xAxisIndex": [0, 1], "filterMode": "none"}],
            "series": [],
        }

    def _line(self, key: str, sid: str, data: list) -> dict:
        _, name, color, grid = next(line for line in LINES if line[0] == key)
        return {"id": sid, "name": name, "type": "line", "data": data, "showSymbol": False, "color": color,
                "xAxisIndex": grid, "yAxisIndex": 0 if grid == 0 else 2, "lineStyle": {"width": 2}}

    def _scatter(self, finishes: list[Finish]) -> list[dict]:
        out = []
        for sid, name, attr, color in (("ttft", "TTFT (ms)", "ttft_s", "#f28e2b"),
                                       ("tpot", "TPOT (ms)", "tpot_s", "#76b7b2")):
            data = [[f.step, round(getattr(f, attr) * 1000, 1), f.request_id] for f in finishes
                    if getattr(f, attr) is not None]
            out.append({"id": sid, "name": name, "type": "scatter", "data": data, "color": color, "symbolSize": 7,
                        "xAxisIndex": 0, "yAxisIndex": 1})
        return out

    def full(self) -> bool:
        for chunks in self.lines.values():
            chunks.clear()
        self.last_point.clear()
        self.n_points, self.n_finishes = 0, -1
        self._add_points()
        series = [self._line(key, sid, d) for key, chunks in self.lines.items() for sid, d in chunks.all()]
        series += self._scatter(self.feed.history.finishes)
        self.n_finishes = len(self.feed.history.finishes)
        self.push(self.chart, {"series": series}, replace_series=True)
        self._kpis()
        return True

    def delta(self, entries: list[LogEntry]) -> bool:
        if not any(e.event["type"] in HEADLINE_EVENTS for e in entries):
            return False
        self._add_points()
        series = [self._line(key, sid, d) for key, chunks in self.lines.items() for sid, d in chunks.take_dirty()]
        if len(self.feed.history.finishes) != self.n_finishes:
            self.n_finishes = len(self.feed.history.finishes)
            series += self._scatter(self.feed.history.finishes)
        if series:
            self.push(self.chart, {"series": series})
        self._kpis()
        return bool(series)

    def _add_points(self) -> None:
        points = self.feed.history.metrics
        kv_cache = self.feed.state.kv_cache
        for point in points[self.n_points:]:
            for key, chunks in self.lines.items():
                y = line_value(point, key) if kv_cache or key not in KV_LINES else None
                if y is None:
                    continue
                value = [point.step, y]
                k = point.step // chunks.size
                if k not in chunks.items and key in self.last_point:
                    chunks.add(point.step, self.last_point[key])  # join the new chunk to the previous one
                chunks.add(point.step, value)
                self.last_point[key] = value
        self.n_points = len(points)

    def _kpis(self) -> None:
        state, history = self.feed.state, self.feed.history
        m = history.last_busy_metrics() if state.finished else (history.metrics[-1] if history.metrics else None)
        tps = history.run_tokens_per_s() if state.finished else (m.tokens_per_s if m else None)
        ttfts = [f.ttft_s for f in history.finishes if f.ttft_s is not None]
        tpots = [f.tpot_s for f in history.finishes if f.tpot_s is not None]
        queues = [f.queue_s for f in history.finishes if f.queue_s is not None]
        finished = sum(1 for r in state.requests.values() if r.status == "finished")
        values = {
            "tps": f"{tps:.0f}" if tps is not None else "–",
            "ttft": f"{1000 * statistics.fmean(ttfts):.0f} ms" if ttfts else "–",
            "tpot": f"{1000 * statistics.fmean(tpots):.1f} ms" if tpots else "–",
            "queue": f"{1000 * statistics.fmean(queues):.0f} ms" if queues else "–",
            "usage": self._usage(m),
            "waste": f"{100 * m.kv_waste:.1f}%" if m and state.kv_cache else "–",
            "hit": f"{100 * m.prefix_hit_rate:.0f}%" if m else "–",
            "saved": str(history.peak_blocks_saved) if history.peak_blocks_saved is not None else "–",
            "preempt": str(state.num_preemptions),
            "done": f"{finished}/{len(state.requests)}",
        }
        if state.config.get("speculative"):
            rate = state.spec.acceptance_rate
            values["spec"] = f"{100 * rate:.0f}%" if rate is not None else "–"
        if state.disaggregation:  # TTFT = queue + prefill + the link's time moving the KV
            moves = [f.transfer_s for f in history.finishes if f.transfer_s is not None]
            values["transfer"] = f"{1000 * statistics.fmean(moves):.1f} ms" if moves else "–"
        self.kpis = values
        self.memory.set(memory_text(state))
        # a finished run's usage is its last busy iteration's (afterwards every block is free): say which
        titles = {"usage": f"KV usage (iteration {m.step})"} if state.finished and m and state.kv_cache else {}
        if state.serves_api:  # the engine's own clock per request, the numbers GET /metrics reports
            titles.update(ttft="mean TTFT", tpot="mean TPOT", queue="mean queue time")
        if state.disaggregation:  # each instance's own clock
            titles.update(ttft="mean TTFT (queue + prefill + transfer)", tpot="mean TPOT (decode instances)")
        self.kpi_row.set(kpi_html(values, titles))
        self._modelled()

    def _usage(self, m: MetricPoint | None) -> str:
        """KV usage: while running, the blocks held now (the block pool's own count, so the two agree
        between iterations too); once finished, the last busy iteration's; no cache, none."""
        state = self.feed.state
        if not state.kv_cache:
            return "no cache"
        if m is None:
            return "–"
        if state.finished:
            return f"{100 * m.kv_usage:.0f}%"
        return f"{100 * blocks_in_use(state) / state.num_blocks:.0f}%" if state.num_blocks else "–"

    def _modelled(self) -> None:
        """The headline's latencies and throughput with each iteration priced on the chosen hardware."""
        state, run = self.feed.state, self.hardware.modelled()
        if state is None or run is None:
            self.modelled.set(self.hardware.problem() or "")
            return
        self.modelled.set(modelled_text(run.latency(state, self.feed.history), self.hardware.label, state.simulated))
