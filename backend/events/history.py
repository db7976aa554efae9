"""What the views need beyond the current state: the past, per iteration, derived from events.

RunState (the one reducer) says what the run looks like *now*. The timeline, the batch chart, the
metrics curves, the attention masks and the sampling panel also need what happened *before*; this
class records it as the events go by, always after `RunState.apply` saw the same event, so that it
can read the reducer's queues at that moment (who was waiting when an iteration ran).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from backend.events.state import RunState

Event = dict[str, Any]
KINDS = ("waiting", "prefill", "decode", "preempted", "verify")
MAX_COLUMNS = 20_000  # iterations kept for the timeline (a long lecture demo is a few thousand)
MAX_MASK_STEPS = 128  # iterations whose attention masks are kept
MAX_TOKENS_PER_REQUEST = 128  # token events (with their distributions) kept per request
MAX_VERIFIES_PER_REQUEST = 64  # spec_verify events (with their p and q) kept per request


class Cell(NamedTuple):
    """A tuple, not a dataclass: a long run keeps millions of these, and tuples of plain values are
    untracked by the garbage collector, whose full passes would otherwise stall the page."""

    request_id: str
    kind: str  # one of KINDS
    tokens: int = 0  # query tokens this iteration (0 while waiting)


@dataclass
class Column:
    """One iteration as the timeline and the batch chart draw it."""

    step: int
    t: float
    duration_s: float
    cells: list[Cell]
    num_batched_tokens: int
    token_budget: int
    max_num_seqs: int | None

    @property
    def scheduled(self) -> list[Cell]:
        return [c for c in self.cells if c.kind in ("prefill", "decode", "verify")]


@dataclass
class MetricPoint:
    step: int
    t: float
    tokens_per_s: float
    kv_usage: float
    kv_waste: float
    prefix_hit_rate: float
    num_preemptions: int
    spec_acceptance_rate: float | None = None  # speculative runs only
    spec_alpha: float | None = None
    spec_tokens_per_verify: float | None = None


@dataclass
class Finish:
    step: int
    request_id: str
    ttft_s: float | None
    tpot_s: float | None


@dataclass
class RunHistory:
    columns: list[Column] = field(default_factory=list)
    metrics: list[MetricPoint] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    masks: dict[int, list[Event]] = field(default_factory=dict)  # step -> attention_mask events
    tokens: dict[str, deque] = field(default_factory=dict)  # request -> its recent token events
    verifies: dict[str, deque] = field(default_factory=dict)  # request -> its recent spec_verify events
    seq_context: dict[int, int] = field(default_factory=dict)  # seq -> tokens in its KV (block fill)
    rows: dict[str, int] = field(default_factory=dict)  # request -> timeline row, arrival order

    def apply(self, event: Event, state: RunState) -> None:
        """Record one event; call right after `state.apply(event)`."""
        handler = getattr(self, f"_on_{event['type']}", None)
        if handler is not None:
            handler(event, state)

    # -- handlers ------------------------------------------------------------------------------

    def _on_request_arrived(self, e: Event, state: RunState) -> None:
        self.rows.setdefault(e["request_id"], len(self.rows))

    def _on_iteration(self, e: Event, state: RunState) -> None:
        cells = [Cell(b["request_id"], b["phase"], b["num_query_tokens"]) for b in e["batch"]]
        for b in e["batch"]:
            self.seq_context[b["seq_id"]] = b["context_len"]
            self.rows.setdefault(b["request_id"], len(self.rows))
        scheduled = {c.request_id for c in cells}
        for rid in state.waiting:  # after the reducer moved the scheduled ones to running
            if rid in scheduled:
                continue
            view = state.requests.get(rid)
            cells.append(Cell(rid, "preempted" if view and view.num_preemptions else "waiting"))
        max_seqs = e.get("max_num_seqs", state.config.get("max_num_seqs"))
        self.columns.append(Column(e["step"], e["t"], e["duration_s"], cells, e["num_batched_tokens"],
                                   e["token_budget"], max_seqs))
        if len(self.columns) > MAX_COLUMNS:
            del self.columns[: len(self.columns) - MAX_COLUMNS]

    def _on_attention_mask(self, e: Event, state: RunState) -> None:
        self.masks.setdefault(e["step"], []).append(e)
        if len(self.masks) > MAX_MASK_STEPS:
            del self.masks[next(iter(self.masks))]  # dicts keep step order

    def _on_token(self, e: Event, state: RunState) -> None:
        self.tokens.setdefault(e["request_id"], deque(maxlen=MAX_TOKENS_PER_REQUEST)).append(e)

    def _on_spec_verify(self, e: Event, state: RunState) -> None:
        self.verifies.setdefault(e["request_id"], deque(maxlen=MAX_VERIFIES_PER_REQUEST)).append(e)

    def _on_metrics(self, e: Event, state: RunState) -> None:
        self.metrics.append(MetricPoint(e["step"], e["t"], e["tokens_per_s"], e["kv_usage"], e["kv_waste"],
                                        e["prefix_hit_rate"], e["num_preemptions"], e.get("spec_acceptance_rate"),
                                        e.get("spec_alpha"), e.get("spec_tokens_per_verify")))

    def _on_request_finished(self, e: Event, state: RunState) -> None:
        self.finishes.append(Finish(e["step"], e["request_id"], e["ttft_s"], e["tpot_s"]))

    def _on_block_free(self, e: Event, state: RunState) -> None:
        if e["seq_id"] not in state.block_tables:
            self.seq_context.pop(e["seq_id"], None)

    # -- starting from a snapshot ----------------------------------------------------------------

    @classmethod
    def from_snapshot(cls, snapshot: dict, state: RunState) -> RunHistory:
        """The part of the past a snapshot still tells: its last iterations and last tokens."""
        history = cls()
        for rid in state.requests:
            history.rows[rid] = len(history.rows)
        for e in snapshot.get("iterations", []):
            history._on_iteration_from_snapshot(e)
        for rid, e in (snapshot.get("last_token_by_request") or {}).items():
            history.tokens.setdefault(rid, deque(maxlen=MAX_TOKENS_PER_REQUEST)).append(e)
        for e in state.recent_verifies:
            history._on_spec_verify(e, state)
        if snapshot.get("metrics"):  # the latest values at least: the curves start there
            history._on_metrics(snapshot["metrics"], state)
        return history

    def _on_iteration_from_snapshot(self, e: Event) -> None:
        # Who was waiting back then is not in a snapshot: only the batch is drawn for those columns.
        cells = [Cell(b["request_id"], b["phase"], b["num_query_tokens"]) for b in e["batch"]]
        for b in e["batch"]:
            self.seq_context[b["seq_id"]] = b["context_len"]
            self.rows.setdefault(b["request_id"], len(self.rows))
        self.columns.append(Column(e["step"], e["t"], e["duration_s"], cells, e["num_batched_tokens"],
                                   e["token_budget"], e.get("max_num_seqs")))

    # -- queries ---------------------------------------------------------------------------------

    def mask_steps(self, request_id: str) -> list[int]:
        """Iterations (oldest first) in which this request has an attention mask on record."""
        return [s for s, events in self.masks.items() if any(m["request_id"] == request_id for m in events)]
