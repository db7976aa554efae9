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

from kvscope.backend.phase import SHOWN_PHASES, shown_phase
from kvscope.backend.events.state import RunState

Event = dict[str, Any]
# A timeline cell's kind: what its request did in the iteration. The computed ones are the phases a
# view shows (phase.py: recompute is a decode step without a KV cache); the others did not run.
COMPUTED = SHOWN_PHASES
KINDS = ("waiting", "preempted", *COMPUTED)
# The kind a request's row shows when its sequences (n > 1, beams) are in different ones in one
# iteration: the one that computes the most (the live timeline and the exported batch chart both ask).
KIND_RANK = {"waiting": 0, "preempted": 1, "decode": 2, "recompute": 2, "verify": 3, "prefill": 4}
MAX_COLUMNS = 20_000  # iterations kept for the timeline (a long lecture demo is a few thousand)
MAX_MASK_STEPS = 128  # iterations whose attention masks are kept
MAX_TOKENS_PER_REQUEST = 128  # token events (with their distributions) kept per request
MAX_VERIFIES_PER_REQUEST = 64  # spec_verify events (with their p and q) kept per request
THROUGHPUT_WINDOW = 16  # iterations the live tokens/s averages over


class Cell(NamedTuple):
    """A tuple, not a dataclass: a long run keeps millions of these, and tuples of plain values are
    untracked by the garbage collector, whose full passes would otherwise stall the page."""

    request_id: str
    kind: str  # one of KINDS
    tokens: int = 0  # query tokens this iteration (0 while waiting)
    context_len: int = 0  # tokens in its KV after this iteration (0 while waiting): what the cost model prices


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
    allreduce: dict[str, Any] | None = None  # tensor parallel: the step's all-reduces {count, bytes, ms} (rank 0's)
    execute_s: float | None = None  # the executor's part of duration_s (None in older traces)
    instances: list[dict[str, Any]] | None = None  # disaggregated: each instance's share of the step

    @property
    def scheduled(self) -> list[Cell]:
        return [c for c in self.cells if c.kind in COMPUTED]


class SeqToken(NamedTuple):
    """One token of one sequence, with the sequence's total log-probability up to it."""

    event: Event  # the token event (its dist feeds the sampling panel)
    cumulative: float | None  # None: the sequence's earlier tokens are not on record (joined mid-run)


@dataclass
class MetricPoint:
    step: int
    t: float
    tokens_per_s: float | None  # in engine time (the iterations' own durations); None: no iteration on record
    kv_usage: float
    kv_waste: float
    prefix_hit_rate: float
    num_preemptions: int
    spec_acceptance_rate: float | None = None  # speculative runs only
    spec_alpha: float | None = None
    spec_tokens_per_verify: float | None = None
    num_running: int | None = None
    blocks_saved_by_sharing: int | None = None


@dataclass
class Finish:
    """A finished request's latencies in engine time: the sum of the durations of the iterations
    between its arrival and its first token (TTFT), then per later token (TPOT), and before the first
    iteration that ran it (queue). The engine's own ttft_s and tpot_s are wall clock, which a paced run
    (4 iterations a second) stretches. The API's run (RunState.serves_api) runs unpaced, as clients wait
    on it: its figures are the engine's own, the very numbers GET /metrics observes. So are a disaggregated
    run's: each instance's own clock (engine time, never paced) and the link's time, which no sum of the
    iterations' durations knows."""

    step: int
    request_id: str
    ttft_s: float | None
    tpot_s: float | None
    queue_s: float | None = None  # arrival to the start of the first iteration that ran it
    transfer_s: float | None = None  # disaggregated: the link's part of ttft_s


@dataclass
class RunHistory:
    columns: list[Column] = field(default_factory=list)
    metrics: list[MetricPoint] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    masks: dict[int, list[Event]] = field(default_factory=dict)  # step -> attention_mask events
    tokens: dict[str, deque] = field(default_factory=dict)  # request -> its recent token events
    verifies: dict[str, deque] = field(default_factory=dict)  # request -> its recent spec_verify events
    seq_context: dict[int, int] = field(default_factory=dict)  # seq -> tokens in its KV (block fill)
    # Per sequence (n > 1 siblings and beams each have their own): its own recent tokens (those
    # inherited at a fork stay with the parent) and the total log-probability of its whole output.
    # The engine emits no running total: it is rebuilt from the tokens' logprobs and the forks.
    seq_tokens: dict[int, deque] = field(default_factory=dict)
    seq_logprob: dict[int, float | None] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)  # request -> timeline row, arrival order
    engine_s: dict[int, float] = field(default_factory=dict)  # step -> engine seconds up to its end
    tokens_at: dict[int, int] = field(default_factory=dict)  # step -> output tokens it produced
    total_engine_s: float = 0.0
    peak_blocks_saved: int | None = None  # the most blocks sharing saved at once, over the metrics on record
    total_tokens: int = 0

    def apply(self, event: Event, state: RunState) -> None:
        """Record one event; call right after `state.apply(event)`."""
        handler = getattr(self, f"_on_{event['type']}", None)
        if handler is not None:
            handler(event, state)

    # -- handlers ------------------------------------------------------------------------------

    def _on_request_arrived(self, e: Event, state: RunState) -> None:
        self.rows.setdefault(e["request_id"], len(self.rows))

    def _on_iteration(self, e: Event, state: RunState) -> None:
        cells = batch_cells(e, state)
        for b in e["batch"]:
            self.seq_context[b["seq_id"]] = b["context_len"]
            self.rows.setdefault(b["request_id"], len(self.rows))
        scheduled = {c.request_id for c in cells}
        for rid in state.waiting:  # after the reducer moved the scheduled ones to running
            if rid in scheduled:
                continue
            view = state.requests.get(rid)
            cells.append(Cell(rid, "preempted" if view and view.num_preemptions else "waiting"))
        self.total_engine_s += e["duration_s"]
        self.engine_s[e["step"]] = self.total_engine_s
        self.columns.append(column_of(e, cells, e.get("max_num_seqs", state.config.get("max_num_seqs"))))
        if len(self.columns) > MAX_COLUMNS:
            del self.columns[: len(self.columns) - MAX_COLUMNS]

    def _on_attention_mask(self, e: Event, state: RunState) -> None:
        self.masks.setdefault(e["step"], []).append(e)
        if len(self.masks) > MAX_MASK_STEPS:
            del self.masks[next(iter(self.masks))]  # dicts keep step order

    def _on_token(self, e: Event, state: RunState) -> None:
        self.tokens_at[e["step"]] = self.tokens_at.get(e["step"], 0) + 1
        self.total_tokens += 1
        self.tokens.setdefault(e["request_id"], deque(maxlen=MAX_TOKENS_PER_REQUEST)).append(e)
        before = self.seq_logprob.get(e["seq_id"], 0.0)
        total = before + e["logprob"] if before is not None else None
        self.seq_logprob[e["seq_id"]] = total
        self.seq_tokens.setdefault(e["seq_id"], deque(maxlen=MAX_TOKENS_PER_REQUEST)).append(SeqToken(e, total))

    def _on_seq_fork(self, e: Event, state: RunState) -> None:
        # The engine forks before the parent appends this step's token (beam_search.py), so the
        # parent's total so far is exactly what the child inherits; so is its KV (shared blocks).
        parent, child = e["parent_seq_id"], e["seq_id"]
        self.seq_logprob[child] = self.seq_logprob.get(parent, 0.0)
        self.seq_context[child] = self.seq_context.get(parent, e["position"])

    def _on_spec_verify(self, e: Event, state: RunState) -> None:
        self.verifies.setdefault(e["request_id"], deque(maxlen=MAX_VERIFIES_PER_REQUEST)).append(e)

    def _on_metrics(self, e: Event, state: RunState) -> None:
        saved = e.get("kv_blocks_saved_by_sharing")
        if saved is not None:  # the run's peak: shared blocks go with the sharers, as a finished run's have
            self.peak_blocks_saved = max(self.peak_blocks_saved or 0, saved)
        self.metrics.append(MetricPoint(e["step"], e["t"], self.engine_tokens_per_s(e["step"]), e["kv_usage"],
                                        e["kv_waste"], e["prefix_hit_rate"], e["num_preemptions"],
                                        e.get("spec_acceptance_rate"), e.get("spec_alpha"),
                                        e.get("spec_tokens_per_verify"), e.get("num_running"),
                                        e.get("kv_blocks_saved_by_sharing")))

    def _on_request_finished(self, e: Event, state: RunState) -> None:
        self._finish(e["request_id"], e["step"], len(e["output_token_ids"]), state)

    def _finish(self, request_id: str, step: int, num_output_tokens: int, state: RunState) -> None:
        view = state.requests.get(request_id)
        if (state.serves_api or state.disaggregation) and view is not None:  # the engine's own figures (above)
            self.finishes.append(Finish(step, request_id, view.ttft_s, view.tpot_s, view.queue_s, view.transfer_s))
            return
        ttft = tpot = None
        if view is not None and view.first_token_step is not None:
            ttft = self.engine_ttft(view.arrival_step, view.first_token_step)
            first = self.engine_s.get(view.first_token_step)
            end = self.engine_s.get(step)  # the iteration event comes first in its step
            later = num_output_tokens - 1
            if first is not None and end is not None and later > 0:
                tpot = (end - first) / later
        queue = self.engine_queue(view.arrival_step, view.first_run_step) if view is not None else None
        self.finishes.append(Finish(step, request_id, ttft, tpot, queue))

    def _on_block_free(self, e: Event, state: RunState) -> None:
        if e["seq_id"] not in state.block_tables:
            self.seq_context.pop(e["seq_id"], None)

    # -- starting from a snapshot ----------------------------------------------------------------

    @classmethod
    def from_snapshot(cls, snapshot: dict, state: RunState) -> RunHistory:
        """The part of the past a snapshot still tells: its last iterations with their output tokens and
        metrics (so throughput, curves and the latencies of requests that lived within them are right),
        and each request's last token."""
        history = cls()
        for rid in state.requests:
            history.rows[rid] = len(history.rows)
        # In step order, each iteration before its metrics: a metrics point reads the throughput so far.
        for e in sorted([*state.iterations, *state.recent_metrics], key=lambda e: (e["step"], e["type"] == "metrics")):
            if e["type"] == "iteration":
                history._on_iteration_from_snapshot(e, state)
            else:
                history._on_metrics(e, state)
        for view in sorted((v for v in state.requests.values() if v.finish_step is not None),
                           key=lambda v: v.finish_step):
            history._finish(view.id, view.finish_step, len(view.output_token_ids), state)
        for seq, rid in state.seq_request.items():  # totals of sequences that had tokens are unknown
            view = state.requests.get(rid)
            if view is not None and view.first_token_step is not None:
                history.seq_logprob[seq] = None
        for rid, e in (snapshot.get("last_token_by_request") or {}).items():
            history.tokens.setdefault(rid, deque(maxlen=MAX_TOKENS_PER_REQUEST)).append(e)
            history.seq_tokens.setdefault(e["seq_id"], deque(maxlen=MAX_TOKENS_PER_REQUEST)).append(SeqToken(e, None))
        for e in state.recent_verifies:
            history._on_spec_verify(e, state)
        return history

    def _on_iteration_from_snapshot(self, e: Event, state: RunState) -> None:
        # Who was waiting back then is not in a snapshot: only the batch is drawn for those columns.
        # Engine seconds count from the first iteration the snapshot kept (differences are what matter).
        cells = batch_cells(e, state)
        for b in e["batch"]:
            self.seq_context[b["seq_id"]] = b["context_len"]
            self.rows.setdefault(b["request_id"], len(self.rows))
        self.columns.append(column_of(e, cells, e.get("max_num_seqs")))
        self.total_engine_s += e["duration_s"]
        self.engine_s[e["step"]] = self.total_engine_s
        tokens = state.step_tokens.get(e["step"], 0)
        self.tokens_at[e["step"]] = tokens
        self.total_tokens += tokens

    # -- queries ---------------------------------------------------------------------------------

    def engine_before(self, step: int) -> float | None:
        """Engine seconds spent before iteration `step` ran (None: that far back is not on record)."""
        first = next(iter(self.engine_s), None)  # dicts keep step order
        if first is None or step <= first:  # a record from a snapshot starts part-way
            return 0.0 if first == 0 or first is None else None
        return self.engine_s.get(step - 1)

    def engine_ttft(self, arrival_step: int, first_token_step: int) -> float | None:
        """Engine seconds from a request's arrival to the end of the iteration that gave its first token.

        A request_arrived event's step is the last iteration before the arrival, so the first that
        can serve it is the next one: iteration `arrival_step` itself ran before it existed."""
        first, before = self.engine_s.get(first_token_step), self.engine_before(arrival_step + 1)
        return first - before if first is not None and before is not None else None

    def engine_queue(self, arrival_step: int, first_run_step: int | None) -> float | None:
        """Engine seconds a request waited: from its arrival to the start of the first iteration that ran it."""
        if first_run_step is None:
            return None
        start, before = self.engine_before(first_run_step), self.engine_before(arrival_step + 1)
        return start - before if start is not None and before is not None else None

    def engine_tokens_per_s(self, step: int) -> float | None:
        """Output tokens per second of engine time over the last THROUGHPUT_WINDOW iterations up to `step`
        (those on record: a page opened mid-run has the snapshot's; with none, None, shown as "–")."""
        recent = [c for c in self.columns[-THROUGHPUT_WINDOW:] if c.step <= step and c.step in self.engine_s]
        seconds = sum(c.duration_s for c in recent)
        if not recent:
            return None
        return sum(self.tokens_at.get(c.step, 0) for c in recent) / seconds if seconds > 0 else 0.0

    def run_tokens_per_s(self) -> float | None:
        """The whole run's output tokens per second of engine time (what a finished run keeps)."""
        return self.total_tokens / self.total_engine_s if self.total_engine_s > 0 else None

    def last_busy_metrics(self) -> MetricPoint | None:
        """The latest metrics taken while something ran: after the last request leaves, usage reads 0."""
        for point in reversed(self.metrics):
            if point.num_running is None or point.num_running > 0:
                return point
        return self.metrics[-1] if self.metrics else None

    def mask_steps(self, request_id: str, seq_id: int | None = None) -> list[int]:
        """Iterations (oldest first) in which this request (or this one of its sequences) has a mask on record."""
        return [s for s, events in self.masks.items()
                if any(m["request_id"] == request_id and seq_id in (None, m["seq_id"]) for m in events)]

    def seq_output(self, state: RunState, seq: int) -> list[SeqToken]:
        """A sequence's whole output on record: the tokens it inherited at its fork(s), then its own."""
        out: list[SeqToken] = []
        limit: int | None = None  # the child's fork position: the parent's tokens from there are not its
        while True:
            out[:0] = [t for t in self.seq_tokens.get(seq, ()) if limit is None or t.event["position"] < limit]
            view = state.sequences.get(seq)
            if view is None or view.parent_seq_id is None:
                return out
            seq, limit = view.parent_seq_id, view.position


def column_of(e: Event, cells: list[Cell], max_num_seqs: int | None) -> Column:
    """An iteration event as the column the timeline and the batch chart draw."""
    return Column(e["step"], e["t"], e["duration_s"], cells, e["num_batched_tokens"], e["token_budget"],
                  max_num_seqs, e.get("allreduce"), e.get("execute_s"), e.get("instances"))


def batch_cells(e: Event, state: RunState) -> list[Cell]:
    """An iteration's batch as cells; without a KV cache a decode step is shown as what it is, a recompute."""
    return [Cell(b["request_id"], shown_phase(b["phase"], state.kv_cache),
                 b["num_query_tokens"], b["context_len"]) for b in e["batch"]]
