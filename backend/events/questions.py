"""Predict, then reveal: the questions a lesson can ask before the run shows the answer.

A lesson step may `ask` one of these (backend/scenario.py: LessonStep.ask). Each kind is two pure
functions. `choices(state)` reads the run's state when the question is asked (a RunState at that
pause) and offers what the room can pick from; `answer(events)` reads the events of the iteration in
which the kind's `reveal` moment happened (backend/events/moments.py) and says which choices were
right. Both come from the run itself, never from the scenario's author, so a question holds for any
model, seed or setting, live or replayed. The lesson pauses after a moment, so a question about a
moment is asked at an earlier step (the start, or an earlier moment) and revealed at that moment's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvscope.backend.events.state import RunState

Event = dict[str, Any]
QuestionKind = Literal["preempt_victim", "shared_blocks", "accepted_before_rejection", "first_pruned",
                       "copies_on_write"]
QUESTION_KINDS: tuple[str, ...] = QuestionKind.__args__


@dataclass(frozen=True)
class AnswerOption:
    """An answer the room can pick (a button)."""

    value: str  # what the answer names
    label: str  # what the button says


@dataclass(frozen=True)
class Question:
    kind: str
    reveal: str  # the moment kind whose iteration answers it
    text: str  # asked when the lesson step gives no wording of its own
    choices: Callable[[RunState], list[AnswerOption]]
    answer: Callable[[list[Event]], frozenset[str]]  # from the reveal iteration's events; empty: not answered


def _numbers(values: set[int]) -> list[AnswerOption]:
    return [AnswerOption(str(v), str(v)) for v in sorted(values)]


def _of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e["type"] == kind]


# -- which request is preempted first (memory pressure) ----------------------------------------------


def _unfinished_requests(state: RunState) -> list[AnswerOption]:
    """Every request not yet finished, in arrival order, with its prompt length (what it will need)."""
    return [AnswerOption(r.id, f"{r.id} · {r.prompt_len} tokens") for r in state.requests.values()
            if r.status not in ("finished", "rejected")]


def _preempted(events: list[Event]) -> frozenset[str]:
    preempts = _of(events, "preempt")
    return frozenset({preempts[0]["request_id"]}) if preempts else frozenset()


# -- how many blocks a prefix hit shares (prefix caching) -------------------------------------------


def _share_counts(state: RunState) -> list[AnswerOption]:
    """0; the shared prefix's full blocks (only full blocks are hashed); the first prompt's full blocks
    and all its blocks. The prefix's length is the scenario's (`generate.shared_prefix.tokens`), if it says."""
    size = state.cache.get("block_size") or 1
    prefix = (((state.scenario or {}).get("generate") or {}).get("shared_prefix") or {}).get("tokens")
    first = next(iter(state.requests.values()), None)
    values = {0}
    if prefix:
        values |= {prefix // size, math.ceil(prefix / size)}
    if first is not None:
        values |= {first.prompt_len // size, math.ceil(first.prompt_len / size)}
    return _numbers(values)


def _blocks_shared(events: list[Event]) -> frozenset[str]:
    """How many blocks the first request to hit the prefix cache in this iteration shared."""
    hits = [e for e in _of(events, "block_share") if e["reason"] == "prefix_cache"]
    if not hits:
        return frozenset()
    return frozenset({str(sum(e["request_id"] == hits[0]["request_id"] for e in hits))})


# -- how many drafts pass before the first rejection (speculative decoding) ---------------------------


def _draft_positions(state: RunState) -> list[AnswerOption]:
    """0 .. k-1: a verify with a rejection accepted fewer than its k drafts."""
    spec = state.config.get("speculative") or {}
    return _numbers(set(range(spec.get("num_tokens") or 0)))


def _accepted_before_rejection(events: list[Event]) -> frozenset[str]:
    rejected = [e for e in _of(events, "spec_verify") if not all(r["accepted"] for r in e["results"])]
    return frozenset({str(rejected[0]["num_accepted"])}) if rejected else frozenset()


# -- which beam is pruned first (beam search) -------------------------------------------------------


def _live_sequences(state: RunState) -> list[AnswerOption]:
    """The live sequences of multi-sequence requests (the beams just forked), by id."""
    return [AnswerOption(str(v.seq_id), f"seq {v.seq_id}")
            for v in sorted(state.sequences.values(), key=lambda v: v.seq_id)
            if v.end_step is None]


def _pruned(events: list[Event]) -> frozenset[str]:
    """Every sequence pruned in this iteration: pruned together, each is a right pick."""
    return frozenset(str(e["seq_id"]) for e in _of(events, "seq_end") if e["reason"] == "pruned")


# -- how many copies the first write into a shared block makes (copy-on-write) ------------------------


def _copy_counts(state: RunState) -> list[AnswerOption]:
    """0 .. the number of live sequences sharing the blocks."""
    live = sum(v.end_step is None for v in state.sequences.values())
    return _numbers(set(range(live + 1)))


def _copies(events: list[Event]) -> frozenset[str]:
    copies = _of(events, "block_copy")
    return frozenset({str(len(copies))}) if copies else frozenset()


QUESTIONS: dict[str, Question] = {q.kind: q for q in (
    Question("preempt_victim", "preempt", "Which request will be preempted first?", _unfinished_requests, _preempted),
    Question("shared_blocks", "prefix_hit", "How many blocks will the first prefix hit share?", _share_counts,
             _blocks_shared),
    Question("accepted_before_rejection", "draft_rejected",
             "At the first rejection, how many drafted tokens will be accepted before it?", _draft_positions,
             _accepted_before_rejection),
    Question("first_pruned", "prune", "Which beam will be pruned first?", _live_sequences, _pruned),
    Question("copies_on_write", "copy_on_write", "When the sequences first write into their shared block, how "
             "many copies of it are made?", _copy_counts, _copies),
)}  # fmt: skip
assert set(QUESTIONS) == set(QUESTION_KINDS)


def step_events(events: list[Event], step: int) -> list[Event]:
    """The events of one iteration (what `answer` reads at the reveal)."""
    return [e for e in events if e.get("step") == step]
