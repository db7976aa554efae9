"""The timeline as a Chrome / Perfetto trace (ui.perfetto.dev, chrome://tracing)."""

from __future__ import annotations

from typing import Any

from kvscope.frontend.export.replayed import Event, ExportedRun, segments


def perfetto_trace(run: ExportedRun) -> dict[str, Any]:
    """The timeline in Chrome's trace event format: one thread per request, times in microseconds."""
    out = [_meta("process_name", 0, f"kvscope · {run.title}"), _meta("thread_name", 0, "engine iterations"),
           _meta("thread_sort_index", 0, 0)]
    for it in run.state.iterations:
        allreduce = it.get("allreduce")  # tensor parallel: the step's all-reduces, rank 0's time in them
        out.append(_span(0, f"step {it['step']}", it["t"] - it["duration_s"], it["t"],
                         {"batch_size": len(it["batch"]), "num_batched_tokens": it["num_batched_tokens"],
                          "token_budget": it["token_budget"], "num_waiting": it["num_waiting"],
                          **({f"allreduce_{k}": v for k, v in allreduce.items()} if allreduce else {})}))
        out.append({"ph": "C", "name": "kv_blocks_used", "pid": 1, "ts": _us(it["t"]),
                    "args": {"blocks": it["kv_blocks_used"]}})
        if allreduce:
            out.append({"ph": "C", "name": "allreduce_ms (rank 0)", "pid": 1, "ts": _us(it["t"] - it["duration_s"]),
                        "args": {"ms": allreduce["ms"]}})
    moments = _moments(run.events)
    for tid, rid in enumerate(run.order, start=1):
        out += [_meta("thread_name", tid, rid), _meta("thread_sort_index", tid, tid)]
        out += _request_events(run, rid, tid, moments)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"run_id": run.state.run_id, "title": run.title, "last_step": run.last}}


def _request_events(run: ExportedRun, rid: str, tid: int, moments: dict[tuple[str, str], list[Event]]) -> list[Event]:
    out = []
    arrived = moments.get(("request_arrived", rid), [])
    for seg in segments(run, rid):
        begin, end = run.at(seg.start, True), run.at(seg.end, True)
        if seg.kind == "waiting" and arrived:
            begin = min(begin, arrived[0]["t"])
        args = {"first_step": seg.start, "last_step": seg.end - 1, "tokens": seg.tokens}
        out.append(_span(tid, seg.kind, begin, end, args))
    for kind, name in (("preempt", "preempted"), ("token", "first token"), ("request_finished", "finished")):
        for e in moments.get((kind, rid), []):
            args = {"step": e["step"], **({"finish_reason": e["finish_reason"]} if kind == "request_finished" else {})}
            out.append({"ph": "i", "s": "t", "name": name, "pid": 1, "tid": tid, "ts": _us(e["t"]), "args": args})
    return out


def _moments(events: list[Event]) -> dict[tuple[str, str], list[Event]]:
    """(type, request id) -> its arrivals, preemptions, finishes, and its first token only."""
    out: dict[tuple[str, str], list[Event]] = {}
    for e in events:
        if e["type"] in ("request_arrived", "preempt", "token", "request_finished"):
            seen = out.setdefault((e["type"], e["request_id"]), [])
            if e["type"] != "token" or not seen:
                seen.append(e)
    return out


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _span(tid: int, name: str, begin: float, end: float, args: dict[str, Any]) -> Event:
    return {"ph": "X", "name": name, "cat": name, "pid": 1, "tid": tid, "ts": _us(begin),
            "dur": max(0.0, _us(end) - _us(begin)), "args": args}


def _meta(name: str, tid: int, value: str | int) -> Event:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"ph": "M", "name": name, "pid": 1, "tid": tid, "args": {key: value}}
