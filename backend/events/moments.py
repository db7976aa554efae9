"""Key moments of a run, found in its events: the first prefix hit, share, copy-on-write, preemption...

A pure detector. `MomentFinder.feed(event)` returns the moments the event completes; a step's
moments complete at its `metrics` event (the engine's last word on a step), at the first event of
a later step, or at `run_finished`, so a moment carries every block its step touched (a prefix hit
shares several blocks at once). Lesson mode pauses at these; being found from the events and not
from step numbers, they hold for any model or setting, live or replayed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

Event = dict[str, Any]
MomentKind = Literal["queued", "slot_refilled", "prefill_chunk", "prompt_cached", "first_decode", "block_added",
                     "prefix_hit", "share", "copy_on_write", "cache_full", "preempt", "recompute", "fork",
                     "prune", "draft_rejected", "first_token", "mask_forced", "one_token_allowed", "request_finished",
                     "bound_changed", "kv_transfer", "finished"]
MOMENT_KINDS: tuple[str, ...] = MomentKind.__args__
# The dashboard's views by name (frontend/column.py), as a lesson step names them.
ViewName = Literal["blocks", "timeline", "batch", "metrics", "block_table", "attention", "sampling", "speculative",
                   "roofline", "kv_calc"]
# Where each moment is seen: the views lesson mode highlights, unless its lesson step names its own.
VIEWS: dict[str, tuple[str, ...]] = {
    "queued": ("timeline", "batch"), "slot_refilled": ("batch", "timeline"),
    "prefill_chunk": ("batch", "timeline"), "prompt_cached": ("blocks", "kv_calc"),
    "first_decode": ("batch", "timeline"), "block_added": ("blocks", "block_table"),
    "prefix_hit": ("blocks", "block_table"), "share": ("blocks", "block_table"),
    "copy_on_write": ("blocks", "block_table"), "cache_full": ("blocks", "metrics"),
    "preempt": ("blocks", "timeline"), "recompute": ("timeline", "batch"), "fork": ("timeline", "blocks"),
    "prune": ("timeline", "blocks"), "draft_rejected": ("speculative",), "first_token": ("sampling",),
    "mask_forced": ("sampling",), "one_token_allowed": ("sampling",),
    "request_finished": ("timeline", "metrics"), "bound_changed": ("roofline", "batch"),
    "kv_transfer": ("blocks", "timeline"), "finished": ("metrics",),
}  # fmt: skip


@dataclass(frozen=True)
class Moment:
    kind: str  # one of MOMENT_KINDS
    step: int  # the iteration it happened in
    seq: int  # the event that completed it (lesson mode shows the state as of this event)
    views: tuple[str, ...]
    blocks: tuple[int, ...] = ()  # the blocks concerned
    request_ids: tuple[str, ...] = ()  # the requests concerned


@dataclass
class _Pending:
    """A moment being gathered during its step."""

    kind: str
    step: int
    blocks: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)

    def add(self, blocks: Iterable[int] = (), request_id: str | None = None) -> None:
        self.blocks += [b for b in blocks if b not in self.blocks]
        if request_id is not None and request_id not in self.request_ids:
            self.request_ids.append(request_id)


class MomentFinder:
    """Feed it every event in order; each kind of moment is reported once, the first time it happens."""

    def __init__(self) -> None:
        self.num_blocks: int | None = None
        self.step = -1
        self.found: set[str] = set()
        self.pending: dict[str, _Pending] = {}
        self.seq_request: dict[int, str] = {}
        self.freed: dict[int, list[int]] = {}  # seq -> blocks freed in the current step
        self.allocated: dict[str, list[int]] = {}  # request -> blocks allocated in the current step
        self.victim: str | None = None  # the first preempted request, until its recompute
        self.prompt_len: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}  # request -> the blocks it holds (all its sequences)
        self.unscheduled: list[str] = []  # arrived, never in a batch yet, in arrival order
        self.waited: set[str] = set()  # requests that sat in the queue through an iteration
        self.finished_step = -2  # the step of the newest request_finished
        self.bound: str | None = None  # the roof the last priced iteration sat under (simulate mode)

    @classmethod
    def joining(cls, num_blocks: int | None, step: int, seq_request: dict[int, str]) -> MomentFinder:
        """A finder for a run joined mid-way (a snapshot): moments are firsts from here on."""
        finder = cls()
        finder.num_blocks, finder.step, finder.seq_request = num_blocks, step, dict(seq_request)
        return finder

    def feed(self, event: Event) -> list[Moment]:
        """The moments this event completes (usually none)."""
        kind, step = event["type"], event.get("step", -1)
        done = self._close(event) if step > self.step and self.pending else []
        if step > self.step:
            self.step, self.freed, self.allocated = step, {}, {}
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(event)
        if kind in ("metrics", "run_finished") and self.pending:
            done += self._close(event)
        return done

    def _close(self, event: Event) -> list[Moment]:
        out = [Moment(p.kind, p.step, event.get("seq", 0), VIEWS[p.kind], tuple(p.blocks), tuple(p.request_ids))
               for p in self.pending.values()]
        self.found.update(self.pending)
        self.pending = {}
        return out

    def _note(self, kind: str) -> _Pending | None:
        """The moment of this kind gathering in this step, or None when it was found already."""
        if kind in self.found:
            return None
        return self.pending.setdefault(kind, _Pending(kind, max(self.step, 0)))

    # -- events --------------------------------------------------------------------------------------

    def _on_header(self, e: Event) -> None:
        self.num_blocks = e["cache"]["num_blocks"]

    def _on_request_arrived(self, e: Event) -> None:
        self.seq_request[e["seq_id"]] = e["request_id"]
        self.prompt_len[e["request_id"]] = len(e["prompt_token_ids"])
        self.unscheduled.append(e["request_id"])

    def _on_request_finished(self, e: Event) -> None:
        self.finished_step = self.step
        if moment := self._note("request_finished"):  # its finish reason is what a lesson reads out
            moment.add(request_id=e["request_id"])

    def _on_token(self, e: Event) -> None:
        if "dist" in e and (moment := self._note("first_token")):  # a draw the sampling view can show
            moment.add(request_id=e["request_id"])
        if "dist" in e and mask_forced(e) and (moment := self._note("mask_forced")):
            moment.add(request_id=e["request_id"])
        if e.get("num_allowed") == 1 and (moment := self._note("one_token_allowed")):
            moment.add(request_id=e["request_id"])

    def _on_seq_fork(self, e: Event) -> None:
        self.seq_request[e["seq_id"]] = e["request_id"]
        if moment := self._note("fork"):
            moment.add(request_id=e["request_id"])

    def _on_block_alloc(self, e: Event) -> None:
        self.seq_request[e["seq_id"]] = e["request_id"]
        self.allocated.setdefault(e["request_id"], []).append(e["block_id"])
        self.tables.setdefault(e["request_id"], []).append(e["block_id"])

    def _on_block_share(self, e: Event) -> None:
        block, rid = [e["block_id"]], e["request_id"]
        self.tables.setdefault(rid, []).append(e["block_id"])
        for kind in ("share", "prefix_hit") if e["reason"] == "prefix_cache" else ("share",):
            if moment := self._note(kind):
                moment.add(block, rid)
        if e["reason"] == "fork" and (moment := self.pending.get("fork")):
            moment.add(block)  # the blocks the first fork shares with its parent

    def _on_block_copy(self, e: Event) -> None:
        if moment := self._note("copy_on_write"):
            moment.add([e["src_block_id"], e["dst_block_id"]], self.seq_request.get(e["seq_id"]))

    def _on_block_free(self, e: Event) -> None:
        self.freed.setdefault(e["seq_id"], []).append(e["block_id"])
        table = self.tables.get(e["request_id"], [])
        if e["block_id"] in table:
            table.remove(e["block_id"])

    def _on_preempt(self, e: Event) -> None:
        if self.victim is None and "recompute" not in self.found:
            self.victim = e["request_id"]
        freed = self.freed.get(e["seq_id"], [])
        if moment := self._note("preempt"):
            moment.add(freed, e["request_id"])
        if moment := self._note("cache_full"):  # the scheduler found no free block for a running request
            moment.add(freed, e["request_id"])

    def _on_iteration(self, e: Event) -> None:
        if self.num_blocks is not None and e["kv_blocks_used"] >= self.num_blocks:
            self._note("cache_full")
        bound = e.get("bound")  # simulate mode prices each iteration under a roof
        if bound is not None and self.bound not in (None, bound):
            self._note("bound_changed")
        self.bound = bound or self.bound
        self._scheduling(e["batch"])
        for entry in e["batch"]:
            self._phase(entry)
        rid = self.victim
        if rid is not None and any(b["request_id"] == rid and b["phase"] == "prefill" for b in e["batch"]):
            self.victim = None
            if moment := self._note("recompute"):
                moment.add(self.allocated.get(rid, []), rid)

    def _scheduling(self, batch: list[dict]) -> None:
        """Who waits, and who takes a slot a finished request freed while others were still decoding."""
        in_batch = {entry["request_id"] for entry in batch}
        newcomers = [rid for rid in self.unscheduled if rid in in_batch]
        self.unscheduled = [rid for rid in self.unscheduled if rid not in in_batch]
        if self.unscheduled and (moment := self._note("queued")):
            moment.add(request_id=self.unscheduled[0])
        self.waited.update(self.unscheduled)
        refilled = [rid for rid in newcomers if rid in self.waited]
        if refilled and self.finished_step >= self.step - 1 and len(in_batch) > len(newcomers) \
                and (moment := self._note("slot_refilled")):  # static batching never refills beside a decode
            moment.add(self.allocated.get(refilled[0], []), refilled[0])

    def _phase(self, entry: dict) -> None:
        """Prefill chunks, a prompt wholly cached, the first decode, a block added while decoding."""
        rid, phase = entry["request_id"], entry["phase"]
        prompt_len = self.prompt_len.get(rid, 0)
        if phase == "prefill" and entry["context_len"] < prompt_len and (moment := self._note("prefill_chunk")):
            moment.add(self.allocated.get(rid, []), rid)
        if phase == "prefill" and entry["context_len"] >= prompt_len and (moment := self._note("prompt_cached")):
            moment.add(self.tables.get(rid, []), rid)
        if phase == "decode" and (moment := self._note("first_decode")):
            moment.add(request_id=rid)
        if phase in ("decode", "verify") and self.allocated.get(rid) and (moment := self._note("block_added")):
            moment.add(self.allocated[rid], rid)

    def _on_seq_end(self, e: Event) -> None:
        if e["reason"] == "pruned" and (moment := self._note("prune")):
            moment.add(self.freed.get(e["seq_id"], []), e["request_id"])

    def _on_spec_verify(self, e: Event) -> None:
        if not all(r["accepted"] for r in e["results"]) and (moment := self._note("draft_rejected")):
            moment.add(request_id=e["request_id"])

    def _on_kv_transfer(self, e: Event) -> None:
        """Disaggregated prefill: a request's blocks leave its prefill instance for its decode instance."""
        if moment := self._note("kv_transfer"):
            moment.add([*e["src_blocks"], *e["dst_blocks"]], e["request_id"])

    def _on_run_finished(self, e: Event) -> None:
        self._note("finished")


def mask_forced(token: Event) -> bool:
    """Whether a grammar's mask removed the model's own likeliest token (its dist.masked holds a token
    the model gave more than any allowed one), so the token drawn is not one the model would have picked."""
    masked = token["dist"].get("masked") or []
    best_allowed = max((row[2] for row in token["dist"]["top"]), default=0.0) * (1.0 - token.get("masked_mass", 0.0))
    return any(row[2] > best_allowed for row in masked)


def lesson_moments(scenario: dict[str, Any] | None) -> frozenset[str]:
    """The moment kinds a scenario's lesson (a header's or the API's scenario dict) pauses at: its steps'
    `at`, less `start` (shown before the run) and `finished` (nothing left to pause)."""
    lesson = (scenario or {}).get("lesson")
    if not isinstance(lesson, list):  # none, or a trace recorded before lessons had steps (one text)
        return frozenset()
    return frozenset(step["at"] for step in lesson if step.get("at") in MOMENT_KINDS and step["at"] != "finished")


def step_views(step: dict[str, Any]) -> tuple[str, ...]:
    """The views a lesson step (a scenario dict's) talks about, in the order its text names them: its own
    `views`, else those of the moment it waits for (none for a `start` step that names none)."""
    return tuple(step.get("views") or VIEWS.get(step.get("at", "start"), ()))


def find_moments(events: Iterable[Event]) -> list[Moment]:
    """Every moment of a recorded run, in the order they complete."""
    finder = MomentFinder()
    return [m for e in events for m in finder.feed(e)]
