"""RunState: the one reducer. `apply(event)` for each event rebuilds what a run looks like.

The server's snapshot, replay's seek, every dashboard view and the block-replay test use it, so
there is exactly one definition of "the state after these events". Events are never mutated.
"""

from __future__ import annotations

import copy
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

Event = dict[str, Any]
API_SCENARIO = "api"  # what the trace header of an OpenAI API run calls it (backend/server/api_run.py)
RECENT_VERIFIES = 64  # spec_verify events kept, so that a page joining mid-run has rows to show


@dataclass
class RequestView:
    id: str
    status: str = "waiting"  # waiting | running | preempted | finished | rejected
    prompt_len: int = 0
    prompt_text: str = ""
    max_tokens: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    # Its first sequence's tokens (with n > 1 or beams, each sequence's are RunHistory.seq_output's) until
    # request_finished puts the returned output here (the best sequence's).
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    arrival_step: int = -1
    first_run_step: int | None = None  # the first iteration that ran it (its queueing ended there)
    first_token_step: int | None = None
    finish_step: int | None = None
    finish_reason: str | None = None
    reason: str | None = None  # why it was aborted or rejected
    num_preemptions: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None  # arrival to the first iteration that ran it
    # disaggregated: its move from a prefill instance to a decode instance (the kv_transfer event's
    # step, src_instance, dst_instance, src_blocks, dst_blocks, bytes, link_s), and the link's part of its TTFT
    transfer: dict[str, Any] | None = None
    transfer_s: float | None = None
    seq_ids: list[int] = field(default_factory=list)  # its sequences: the first, then each fork (n > 1, beams)
    outputs: list[dict[str, Any]] | None = None  # every returned sequence, best first (n > 1, beams)
    joined: bool = False  # first seen running: it arrived before the trace began (prompt, first token unknown)


@dataclass
class SeqView:
    """One sequence of a multi-sequence request (n > 1, beam search): where it branched and ended."""

    seq_id: int
    request_id: str
    parent_seq_id: int | None = None  # None: a root (the request's first sequence)
    position: int = 0  # tokens inherited from the parent at the fork
    start_step: int = -1
    end_step: int | None = None
    end_reason: str | None = None  # eos | stop | length | abort | pruned


@dataclass
class SpecTotals:
    """Speculative decoding so far, counted from spec_verify events (exact, unlike a windowed rate)."""

    verifies: int = 0
    proposed: int = 0
    accepted: int = 0
    appended: int = 0  # tokens the verifies appended: accepted + the resampled or bonus one

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_verify(self) -> float | None:
        return self.appended / self.verifies if self.verifies else None


# A plain field the server may know better than the events it hands out: a replay ends with its
# trace, or fails, without those events saying so. A client that rebuilds the state from the events
# (a snapshot's `past`) takes such a field from the snapshot instead.
SERVERS_WORD = {"servers_word": True}


@dataclass(eq=False, repr=False)  # eq=False: a RunState is equal to itself only, and stays hashable
class PlainState:
    """The reducer's fields that a snapshot carries under their own names, as they are (JSON already).

    The one list of them: `RunState.snapshot()`, `RunState.from_snapshot()` and the dashboard's client
    (frontend/client.py) all read it, so a new such field is one line here."""

    schema_version: int | None = None
    run_id: str | None = None
    scenario: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, Any] | None = None  # quantization and bytes; absent in old traces
    draft_model: dict[str, Any] | None = None  # speculative decoding with a draft model
    simulated: bool = False  # simulate mode: no weights ran, the iterations' times are modelled
    device: str | None = None  # torch's device the run ran on ("cpu", "cuda:0"): whose clock its times are
    # The model sharded over ranks (header `tensor_parallel`): what each rank holds; None for one process
    tensor_parallel: dict[str, Any] | None = None
    # Prefill and decode on instances of their own (header `disaggregation`): each instance's role and blocks
    disaggregation: dict[str, Any] | None = None
    step: int = -1
    waiting: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    last_token_by_request: dict[str, Event] = field(default_factory=dict)
    metrics: Event | None = None
    num_preemptions: int = 0
    finished: bool = field(default=False, metadata=SERVERS_WORD)
    finish_reason: str | None = field(default=None, metadata=SERVERS_WORD)
    # A fatal error event ended the run (finished too, finish_reason "failed").
    failed: bool = field(default=False, metadata=SERVERS_WORD)
    error: str | None = field(default=None, metadata=SERVERS_WORD)  # the newest error event's message


PLAIN_FIELDS = tuple(f.name for f in fields(PlainState))
SERVER_FIELDS = tuple(f.name for f in fields(PlainState) if f.metadata.get("servers_word"))


@functools.cache
def handlers_of(cls: type) -> dict[str, Callable[[Any, Event], None]]:
    """Event type -> the reducer class's handler, unbound. Per class, not per instance: a table of bound
    methods in the instance is a cycle only a full garbage collection frees, and a replay's reducer (with the
    events it keeps) outlived its closed replay by minutes."""
    return {name.removeprefix("_on_"): getattr(cls, name) for name in dir(cls) if name.startswith("_on_")}


class RunState(PlainState):
    """Block tables, free list, queues, requests and metrics, as the events say they are.

    Not how the run is paced (paused, speed, lesson mode): that is the served run's, and its viewers'
    (backend/events/pacing.py), so `control` events change nothing here."""

    def __init__(self, max_iterations: int = 256, max_finished: int | None = None):
        self.max_iterations = max_iterations
        self.max_finished = max_finished  # finished requests kept (oldest forgotten first); None: all
        self._handlers = handlers_of(type(self))
        self._reset()

    def _reset(self) -> None:
        PlainState.__init__(self)
        self.block_tables: dict[int, list[int]] = {}
        self.ref_counts: dict[int, int] = {}
        self.block_owner: dict[int, set[int]] = {}
        self._free: dict[int, None] = {}  # an ordered set: O(1) removal from the middle
        self.cached_blocks: set[int] = set()  # free blocks still findable by prefix hash
        self.seq_request: dict[int, str] = {}
        self.requests: dict[str, RequestView] = {}
        self._finished_ids: deque[str] = deque()  # finished and rejected requests, oldest first
        self.sequences: dict[int, SeqView] = {}  # only the sequences of multi-sequence requests
        self.draft_seqs: dict[int, int] = {}  # draft model's sequence -> the target sequence it drafts for
        self.spec = SpecTotals()
        self.recent_verifies: deque[Event] = deque(maxlen=RECENT_VERIFIES)
        self.iterations: deque[Event] = deque(maxlen=self.max_iterations)
        # The past a page joining mid-run needs besides the iterations: each kept step's output tokens
        # (its throughput) and the metrics of as many steps (its curves).
        self.step_tokens: dict[int, int] = {}
        self.recent_metrics: deque[Event] = deque(maxlen=self.max_iterations)
        self.last_seq = -1

    @property
    def free_blocks(self) -> list[int]:
        """Free block ids, oldest-freed first."""
        return list(self._free)

    @property
    def num_blocks(self) -> int:
        return self.cache.get("num_blocks", 0)

    @property
    def kv_cache(self) -> bool:
        """Whether the run keeps a KV cache (engine.kv_cache); without one every step recomputes the context."""
        return self.config.get("kv_cache", True) is not False

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by a sequence now: the pool less its free blocks (a cached prefix's free block is free).
        The one count every figure of KV usage reads (the block pool's caption, the metrics' headline, GET
        /metrics), so at any moment they agree, and at the end of an iteration they equal its metrics
        event's kv_usage."""
        return self.num_blocks - len(self._free) if self.kv_cache else 0

    @property
    def kv_usage(self) -> float:
        """blocks_in_use over the pool (0 without a cache)."""
        return self.blocks_in_use / self.num_blocks if self.num_blocks else 0.0

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """What each tensor-parallel rank holds (heads, KV heads, bytes), rank 0 first; [] for one process.
        One block table drives them all: block i is the same tokens in every rank's pool."""
        return (self.tensor_parallel or {}).get("ranks", [])

    @property
    def serves_api(self) -> bool:
        """The open-ended run that serves the OpenAI API: its scenario, built by the server, has no requests
        of its own (a scenario file must have some). Its latencies are the engine's own clock (docs/api.md)."""
        return bool(self.scenario) and (self.scenario.get("name") == API_SCENARIO and not self.scenario.get("requests")
                                        and not self.scenario.get("generate"))

    def apply(self, event: Event) -> None:
        handler = self._handlers.get(event["type"])
        if handler is not None:  # types this reducer does not track are fine
            handler(self, event)
        self.step = event["step"]
        self.last_seq = event["seq"]

    # -- run ---------------------------------------------------------------------------------

    def _on_header(self, e: Event) -> None:
        self._reset()
        self.schema_version = e["schema_version"]
        self.run_id = e["run_id"]
        self.scenario = e["scenario"]
        self.config = e["config"]
        self.model = e["model"]
        self.cache = e["cache"]
        self.weights = e.get("weights")
        self.draft_model = e.get("draft_model")
        self.simulated = e.get("simulated") is True  # headers before simulate mode do not say
        self.device = e.get("device")
        self.tensor_parallel = e.get("tensor_parallel")
        self.disaggregation = e.get("disaggregation")
        self._free = dict.fromkeys(range(self.cache["num_blocks"]))

    def _on_iteration(self, e: Event) -> None:
        self.iterations.append(e)
        oldest = self.iterations[0]["step"]
        while self.step_tokens and (first := next(iter(self.step_tokens))) < oldest:  # dicts keep step order
            del self.step_tokens[first]
        for entry in e["batch"]:
            self.seq_request[entry["seq_id"]] = entry["request_id"]
            self._mark_running(entry["request_id"], e["step"])

    def _on_metrics(self, e: Event) -> None:
        self.metrics = e
        self.recent_metrics.append(e)

    def _on_run_finished(self, e: Event) -> None:
        self.finished = True
        self.finish_reason = e["reason"]

    def _on_error(self, e: Event) -> None:
        self.error = e["message"]
        if e["fatal"]:
            self.failed = self.finished = True
            self.finish_reason = "failed"

    # -- requests ----------------------------------------------------------------------------

    def _on_request_arrived(self, e: Event) -> None:
        rid = e["request_id"]
        self.requests[rid] = RequestView(
            id=rid,
            prompt_len=len(e["prompt_token_ids"]),
            prompt_text=e["prompt_text"],
            max_tokens=e["max_tokens"],
            sampling=e["sampling"],
            arrival_step=e["step"],
            seq_ids=[e["seq_id"]],
        )
        self.seq_request[e["seq_id"]] = rid
        self.waiting.append(rid)

    def _on_request_rejected(self, e: Event) -> None:
        rid = e["request_id"]
        if rid is None:
            return
        view = self.requests.setdefault(rid, RequestView(id=rid, arrival_step=e["step"]))
        view.status = "rejected"
        view.reason = f"{e['field']}: {e['reason']}"
        self._leave_queues(rid)
        self._retire(rid)

    def _mark_running(self, rid: str, step: int) -> None:
        # A request first named by an iteration arrived before the trace began (the server's windowed
        # /trace): it is running, its prompt unknown. Live runs never get here; finished ones never run again.
        view = self.requests.setdefault(rid, RequestView(id=rid, joined=True))
        if view.status in ("running", "finished", "rejected"):
            return
        if view.first_run_step is None and not view.joined:
            view.first_run_step = step
        self._leave_queues(rid)
        self.running.append(rid)
        view.status = "running"

    def _on_preempt(self, e: Event) -> None:
        self.num_preemptions += 1
        rid = e["request_id"]
        view = self.requests.get(rid)
        if view is None:
            return
        view.num_preemptions += 1
        view.status = "preempted"
        if rid in self.running:
            self.running.remove(rid)
        if rid not in self.waiting:  # n > 1: its other sequences may have put it back already
            self.waiting.insert(0, rid)

    def _on_token(self, e: Event) -> None:
        rid = e["request_id"]
        self.last_token_by_request[rid] = e
        self.step_tokens[e["step"]] = self.step_tokens.get(e["step"], 0) + 1
        self.seq_request[e["seq_id"]] = rid
        view = self.requests.get(rid)
        if view is None:
            return
        if not view.seq_ids:  # first seen by its token: a trace that began mid-run
            view.seq_ids.append(e["seq_id"])
        if e["seq_id"] == view.seq_ids[0]:  # the first sequence's reply: the others never mix into it
            view.output_token_ids.append(e["token_id"])
            view.output_text += e["text"]
        if view.first_token_step is None and not view.joined:  # a joined one's came before the trace
            view.first_token_step = e["step"]

    def _on_request_finished(self, e: Event) -> None:
        rid = e["request_id"]
        view = self.requests.setdefault(rid, RequestView(id=rid))
        view.status = "finished"
        view.finish_step = e["step"]
        view.finish_reason = e["finish_reason"]
        view.reason = e.get("reason")
        view.output_token_ids = list(e["output_token_ids"])
        view.output_text = e["output_text"]
        view.ttft_s, view.tpot_s, view.e2e_s = e["ttft_s"], e["tpot_s"], e["e2e_s"]
        view.queue_s = e.get("queue_s")  # absent in traces older than the field
        view.transfer_s = e.get("transfer_s")  # only after a move between disaggregated instances
        view.outputs = e.get("outputs")
        self._leave_queues(rid)
        self._retire(rid)

    def _on_kv_transfer(self, e: Event) -> None:
        view = self.requests.get(e["request_id"])
        if view is not None:
            view.transfer = {k: e[k] for k in ("step", "src_instance", "dst_instance", "src_blocks", "dst_blocks",
                                               "bytes", "link_s")}

    @property
    def instances(self) -> list[dict[str, Any]]:
        """A disaggregated run's instances ({instance, role, first_block, num_blocks}); empty for one engine."""
        return (self.disaggregation or {}).get("instances", [])

    def _retire(self, rid: str) -> None:
        """A run that lives forever keeps only the newest max_finished finished requests."""
        if self.max_finished is None:
            return
        self._finished_ids.append(rid)
        while len(self._finished_ids) > self.max_finished:
            old = self.requests.pop(self._finished_ids.popleft(), None)
            if old is None:
                continue
            self.last_token_by_request.pop(old.id, None)
            for seq in old.seq_ids:  # their blocks went back with request_finished
                self.seq_request.pop(seq, None)
                self.sequences.pop(seq, None)

    def _leave_queues(self, rid: str) -> None:
        if rid in self.waiting:
            self.waiting.remove(rid)
        if rid in self.running:
            self.running.remove(rid)

    # -- sequences: forks, ends, speculation --------------------------------------------------

    def _sequence(self, seq: int, rid: str) -> SeqView:
        """The sequence's record, created as a root starting at its request's arrival if new."""
        view = self.sequences.get(seq)
        if view is None:
            request = self.requests.get(rid)
            view = self.sequences[seq] = SeqView(seq, rid, start_step=request.arrival_step if request else self.step)
        return view

    def _on_seq_fork(self, e: Event) -> None:
        rid = e["request_id"]
        self._sequence(e["parent_seq_id"], rid)  # a fork makes its parent one of several too
        child = self._sequence(e["seq_id"], rid)
        child.parent_seq_id, child.position, child.start_step = e["parent_seq_id"], e["position"], e["step"]
        self.seq_request[e["seq_id"]] = rid
        request = self.requests.get(rid)
        if request is not None and e["seq_id"] not in request.seq_ids:
            request.seq_ids.append(e["seq_id"])

    def _on_seq_end(self, e: Event) -> None:
        view = self._sequence(e["seq_id"], e["request_id"])
        view.end_step, view.end_reason = e["step"], e["reason"]

    def _on_spec_propose(self, e: Event) -> None:
        if e.get("draft_seq_id") is not None:
            self.draft_seqs[e["draft_seq_id"]] = e["seq_id"]
            self.seq_request[e["draft_seq_id"]] = e["request_id"]

    def _on_spec_verify(self, e: Event) -> None:
        self.recent_verifies.append(e)
        self.spec.verifies += 1
        self.spec.proposed += len(e["results"])
        self.spec.accepted += e["num_accepted"]
        closing = e["resampled_token_id"] is not None or e["bonus_token_id"] is not None
        self.spec.appended += e["num_accepted"] + int(closing)

    # -- blocks ------------------------------------------------------------------------------

    def _on_block_alloc(self, e: Event) -> None:
        block = e["block_id"]
        self._place(e["seq_id"], e["logical_index"], block)
        self.seq_request[e["seq_id"]] = e["request_id"]
        self.ref_counts[block] = 1
        self.block_owner[block] = {e["seq_id"]}
        self._free.pop(block, None)
        self.cached_blocks.discard(block)  # its old contents are about to be overwritten

    def _on_block_share(self, e: Event) -> None:
        block = e["block_id"]
        self._place(e["seq_id"], e["logical_index"], block)
        self.seq_request[e["seq_id"]] = e["request_id"]
        self.ref_counts[block] = e["ref_count"]
        self.block_owner.setdefault(block, set()).add(e["seq_id"])
        self._free.pop(block, None)  # a prefix hit on a freed-but-cached block revives it
        self.cached_blocks.discard(block)

    def _on_block_copy(self, e: Event) -> None:
        # Ref counts move with the block_alloc / block_free events around the copy; here only the
        # table entry changes (if the alloc already put dst in place there is nothing to do).
        src, dst, seq = e["src_block_id"], e["dst_block_id"], e["seq_id"]
        table = self.block_tables.get(seq, [])
        if src not in table:
            return
        table[table.index(src)] = dst
        self.block_owner.get(src, set()).discard(seq)
        self.block_owner.setdefault(dst, set()).add(seq)

    def _on_block_free(self, e: Event) -> None:
        block, seq = e["block_id"], e["seq_id"]
        self._unplace(seq, block)
        self.block_owner.get(block, set()).discard(seq)
        ref_count = self.ref_counts.get(block, 1) - 1
        if ref_count > 0:  # still shared: only the count drops
            self.ref_counts[block] = ref_count
            return
        self.ref_counts.pop(block, None)
        self.block_owner.pop(block, None)
        self._free[block] = None
        if e["cached"]:
            self.cached_blocks.add(block)
        else:
            self.cached_blocks.discard(block)

    def _on_block_evict(self, e: Event) -> None:
        self.cached_blocks.discard(e["block_id"])

    def _place(self, seq: int, logical_index: int, block: int) -> None:
        table = self.block_tables.setdefault(seq, [])
        if logical_index >= len(table):
            table.extend([-1] * (logical_index + 1 - len(table)))  # -1: a hole, never expected
        replaced, table[logical_index] = table[logical_index], block
        if replaced != block and replaced not in table:  # copy-on-write: the alloc replaces src
            self.block_owner.get(replaced, set()).discard(seq)

    def _unplace(self, seq: int, block: int) -> None:
        table = self.block_tables.get(seq)
        if table is None or block not in table:
            return
        # Sequences free tail first, so the last occurrence is the one being dropped.
        del table[len(table) - 1 - table[::-1].index(block)]
        if not table:
            del self.block_tables[seq]

    # -- snapshot ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The whole state as a JSON-able dict (a websocket client's starting point)."""
        # Copies, however plain: the reducer edits some (the queues) in place, and a snapshot must not move.
        return {
            **{name: copy.copy(getattr(self, name)) for name in PLAIN_FIELDS},
            "seq": self.last_seq,
            "block_tables": {seq: list(table) for seq, table in self.block_tables.items()},
            "ref_counts": dict(self.ref_counts),
            "free_blocks": self.free_blocks,
            "cached_blocks": sorted(self.cached_blocks),
            "seq_request": dict(self.seq_request),
            "requests": {rid: asdict(view) for rid, view in self.requests.items()},
            "iterations": list(self.iterations),
            "sequences": {seq: asdict(view) for seq, view in self.sequences.items()},
            "draft_seqs": dict(self.draft_seqs),
            "spec": asdict(self.spec),
            "recent_verifies": list(self.recent_verifies),
            "step_tokens": dict(self.step_tokens),
            "recent_metrics": list(self.recent_metrics),
        }

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any], max_iterations: int = 256) -> RunState:
        """The state a snapshot describes; also accepts one that went through JSON (str keys)."""
        d = copy.deepcopy(snapshot)
        state = cls(max_iterations)
        for name in PLAIN_FIELDS:
            setattr(state, name, d[name])
        state.last_seq = d["seq"]
        state.block_tables = {int(seq): table for seq, table in d["block_tables"].items()}
        state.ref_counts = {int(block): count for block, count in d["ref_counts"].items()}
        state.block_owner = _owners(state.block_tables)
        state._free = dict.fromkeys(d["free_blocks"])
        state.cached_blocks = set(d["cached_blocks"])
        state.seq_request = {int(seq): rid for seq, rid in d["seq_request"].items()}
        state.requests = {rid: RequestView(**view) for rid, view in d["requests"].items()}
        state.iterations.extend(d["iterations"])
        state.sequences = {int(seq): SeqView(**view) for seq, view in d["sequences"].items()}
        state.draft_seqs = {int(seq): target for seq, target in d["draft_seqs"].items()}
        state.spec = SpecTotals(**d["spec"])
        state.recent_verifies.extend(d["recent_verifies"])
        state.step_tokens = {int(step): n for step, n in d["step_tokens"].items()}
        state.recent_metrics.extend(d["recent_metrics"])
        return state


def _owners(block_tables: dict[int, list[int]]) -> dict[int, set[int]]:
    owners: dict[int, set[int]] = {}
    for seq, table in block_tables.items():
        for block in table:
            owners.setdefault(block, set()).add(seq)
    owners.pop(-1, None)
    return owners
