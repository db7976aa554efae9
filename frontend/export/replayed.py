"""The events up to a step, replayed into a RunRecord, and what the pictures read from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.backend.events.history import KIND_RANK, RunHistory
from kvscope.backend.events.record import RunRecord
from kvscope.backend.events.state import RunState
from kvscope.frontend.export.options import ExportError

Event = dict[str, Any]


@dataclass
class ExportedRun:
    """A recorded run as the pictures draw it: its events up to the chosen step, replayed."""

    events: list[Event]
    state: RunState
    history: RunHistory
    order: list[str]  # ids of the requests not rejected, in arrival order
    batches: dict[int, dict[str, tuple[str, int]]]  # iteration -> request -> (phase, query tokens)
    ran: dict[str, list[int]]  # request -> the iterations it was in, ascending
    starts: dict[int, float]  # iteration -> t when it started
    end_t: float  # t when the last iteration ended
    last: int  # the last iteration
    first: int  # the first iteration (a trace that starts mid-run, the server's windowed /trace: not 0)
    trace_last: int  # the trace's last iteration (past `last` when replayed up to a step)
    peak: int  # the trace's first iteration with the most KV blocks in use

    @property
    def scenario(self) -> str:
        return (self.state.scenario or {}).get("name") or f"run {self.state.run_id}"

    @property
    def model_name(self) -> str:
        return Path(str(self.state.model.get("name", "?"))).name

    @property
    def title(self) -> str:
        return f"{self.scenario} · model {self.model_name}"

    def at(self, boundary: int, seconds: bool) -> float:
        """x of the boundary before iteration `boundary`: the step number, or when it started."""
        if not seconds:
            return float(boundary)
        return self.starts.get(boundary, self.end_t if boundary > self.last else self.starts[self.last])


@dataclass
class Segment:
    kind: str  # waiting | prefill | decode | verify | preempted
    start: int  # first iteration
    end: int  # one past the last iteration
    tokens: int = 0


def replay(events: list[Event], step: int | None = None) -> ExportedRun:
    """Replay the events (those of iterations up to `step`, if given) into a fresh RunRecord."""
    if not events or events[0].get("type") != "header":
        raise ExportError("trace", "the first event must be a header")
    iterations = [e for e in events if e["type"] == "iteration"]
    if not iterations:
        raise ExportError("trace", "no iteration events to draw (recorded with engine.events=off?)")
    first, last = iterations[0]["step"], iterations[-1]["step"]
    trace_last, peak = last, busiest_step(iterations)
    if step is not None and not first <= step <= last:
        raise ExportError("step", f"{step} is outside the trace's iterations {first}..{last}")
    if step is not None:
        events = [e for e in events if e["step"] <= step]
        iterations = [e for e in iterations if e["step"] <= step]
    record = RunRecord.from_events(events, max_iterations=len(iterations))
    state, history = record.state, record.history
    batches = _batches(history)
    ran: dict[str, list[int]] = {}
    for step in sorted(batches):
        for rid in batches[step]:
            ran.setdefault(rid, []).append(step)
    order = [rid for rid, view in state.requests.items() if view.status != "rejected"]
    return ExportedRun(events, state, history, order, batches, ran,
                       {it["step"]: it["t"] - it["duration_s"] for it in iterations}, iterations[-1]["t"],
                       iterations[-1]["step"], first, trace_last, peak)


def busiest_step(events: list[Event]) -> int | None:
    """The first iteration with the most KV blocks in use (None without iterations)."""
    iterations = [e for e in events if e["type"] == "iteration"]
    return max(iterations, key=lambda it: it["kv_blocks_used"])["step"] if iterations else None


def _batches(history: RunHistory) -> dict[int, dict[str, tuple[str, int]]]:
    """Per iteration, per request: its phase (prefill wins over its other sequences', then verify) and tokens."""
    out: dict[int, dict[str, tuple[str, int]]] = {}
    for column in history.columns:
        per = out.setdefault(column.step, {})
        for cell in column.scheduled:
            phase, tokens = per.get(cell.request_id, (cell.kind, 0))
            per[cell.request_id] = (max(phase, cell.kind, key=KIND_RANK.__getitem__), tokens + cell.tokens)
    return out


def segments(run: ExportedRun, rid: str) -> list[Segment]:
    """One request's [start, end) iteration ranges: waiting, prefill chunks, decode runs, preempted gaps.

    Read from RunHistory's columns (the live timeline's cells): each prefill chunk is its own
    segment; consecutive waiting, preempted, decode or verify iterations merge into one."""
    segs: list[Segment] = []
    for column in run.history.columns:
        kind, tokens = run.batches[column.step].get(rid) or next(
            ((c.kind, 0) for c in column.cells if c.request_id == rid), (None, 0))
        if kind is None:
            continue
        last = segs[-1] if segs else None
        if kind != "prefill" and last and last.kind == kind and last.end == column.step:
            last.end, last.tokens = column.step + 1, last.tokens + tokens
        else:
            segs.append(Segment(kind, column.step, column.step + 1, tokens))
    return segs
