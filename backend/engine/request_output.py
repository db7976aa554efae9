"""What the engine reports, as plain records, in the order things happened.

The scheduler returns these from every stage that changes state (`schedule`, `update_from_output`,
`update_from_drafts`, `add_request`, `abort`); the engine turns each into its event (step_events.py)
and hands a request's own ones (`RequestOutput`: Arrived, Forked, Token, Finished) to its caller's
sink. The OpenAI API answers from that stream, not from the trace: it is the same at every `events`
level (a server may run its API at `events: off`), and it costs no JSON encoding and no reducer.
The other records (blocks, preemptions, drafts) are for the events alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.step_output import MaskEffect, RowOutput, TopLogprobs



# ---- a request's own outputs: the API's stream -------------------------------------------------------

@dataclass(frozen=True)
class Arrived:
    request_id: str
    seq_id: int  # the request's first sequence
    num_prompt_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    sampling: SamplingParams | None = None
    max_tokens: int = 0


@dataclass(frozen=True)
class Forked:
    """A new sequence of the request (n > 1, beam search), numbered in fork order."""

    request_id: str
    seq_id: int
    parent_seq_id: int = -1
    position: int = 0  # the parent's length when the child was forked


@dataclass(frozen=True)
class Token:
    request_id: str
    seq_id: int
    token_id: int
    logprob: float  # of its raw (T=1) probability
    top_logprobs: TopLogprobs | None  # when the request asks for them
    # The output text this token made final: deltas add up to the sequence's output_text. Held back
    # where a stop string could still begin, cut before one that appeared; "" for beam search, whose
    # hypotheses are decoded when they end.
    text: str = ""
    position: int = 0  # where the token sits in its sequence
    source: str = "target"  # target | draft_accepted | resampled | bonus
    # for the token event alone
    params: SamplingParams | None = None  # the `dist` event field names the settings it was drawn with
    dist: list[list] | None = None  # [token, raw p, final p] rows of its distribution (events at `full`)
    raw_probs: torch.Tensor | None = None  # [V] the whole T=1 row, kept for the sampling view's what-if
    grammar: MaskEffect | None = None  # what a structured output's mask did at this position


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: str
    # What it returns, best first: seq_id, output_token_ids, output_text, finish_reason, cumulative_logprob, score
    outputs: tuple[dict, ...]
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held (not computed again)
    reason: str | None = None  # why it was aborted
    multi: bool = False  # it had (or would have had) several sequences
    times: dict[str, float | None] = field(default_factory=dict)  # ttft_s, tpot_s, e2e_s, queue_s
    # The request failed by its own fault (a row it could not sample: its grammar allows no token): the
    # API answers with an error, where an abort (the client left, the server stops) is a finish reason.
    error: str | None = None


RequestOutput = Arrived | Forked | Token | Finished
Sink = Callable[[RequestOutput], None]


def ignore(_: RequestOutput) -> None:
    """The sink of an engine nobody reads from (a scenario run: its events are its answer)."""


# ---- what only the events report -------------------------------------------------------------------

@dataclass(frozen=True)
class Rejected:
    request_id: str
    field: str | None
    reason: str


@dataclass(frozen=True)
class SeqEnded:
    """One sequence of a request with several ended (n > 1, beam search)."""

    request_id: str
    seq_id: int
    reason: str


@dataclass(frozen=True)
class Preempted:
    request_id: str
    seq_id: int
    num_blocks_freed: int


@dataclass(frozen=True)
class BlockChange:
    """One change the block manager made, as its `emit` reported it (its docstring is their contract)."""

    type: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Drafted:
    """Drafts proposed for a sequence's next step."""

    request_id: str
    seq_id: int
    position: int  # the target's length: the first draft's position
    token_ids: list[int]
    q_probs: list[float]  # each draft's probability under the proposer (1.0 for an n-gram copy)
    method: str
    draft_seq_id: int | None  # the draft model's own sequence (None for n-gram lookup)


@dataclass(frozen=True)
class Verified:
    """A verify row's verdict on its drafts (RowOutput's verify fields)."""

    request_id: str
    seq_id: int
    position: int  # the first draft's position
    drafts: list[int]
    row: RowOutput


EngineOutput = RequestOutput | Rejected | SeqEnded | Preempted | BlockChange | Drafted | Verified
