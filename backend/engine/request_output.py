"""What the engine hands its caller of each request, as plain data: arrival, forks, tokens, finish.

The OpenAI API answers from this stream, not from the trace: it is the same at every `events`
level (a server may run its API at `events: off`), and it costs no JSON encoding and no reducer.
The trace's events observe the same moments for the dashboard; a change of their schema is not a
change of the API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrived:
    request_id: str
    seq_id: int  # the request's first sequence
    num_prompt_tokens: int


@dataclass(frozen=True)
class Forked:
    """A new sequence of the request (n > 1, beam search), numbered in fork order."""

    request_id: str
    seq_id: int


@dataclass(frozen=True)
class Token:
    request_id: str
    seq_id: int
    token_id: int
    logprob: float  # of its raw (T=1) probability
    top_logprobs: tuple[tuple[int, float], ...] | None  # (token, logprob) likeliest first, when the request asks


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: str
    # What it returns, best first: seq_id, output_token_ids, output_text, finish_reason, cumulative_logprob, score
    outputs: tuple[dict, ...]
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held (not computed again)


RequestOutput = Arrived | Forked | Token | Finished
Sink = Callable[[RequestOutput], None]


def ignore(_: RequestOutput) -> None:
    """The sink of an engine nobody reads from (a scenario run: its events are its answer)."""
