"""What the executor hands back for a StepInput, as plain data: tokens and numbers, no sequence.

One `RowOutput` per row of the StepInput. A row that samples drew one token per stream (n streams
at the first token of an n > 1 request, else one); a verify row lists the drafts it accepted and
the token the target added after them; a beam row hands back its best candidates for the beam
ranking (beam_search.select). The scheduler's `update_from_output` turns these into request state
and into the step's outputs (request_output.py), from which the events and the API's stream are
built. `DraftOutput` is the answer to a DraftInput: drafted ids, never distributions.

The optional tensors are for observers only: `tops` (the top-N distribution rows a token event
draws) and `raw_probs` (the whole T=1 row the sampling view's what-if keeps) are computed only when
the StepInput asks for them (`dist_top_n`, `keep_raw`). With events off a step returns ids alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TopLogprobs = tuple[tuple[int, float], ...]  # (token, logprob), likeliest first


@dataclass
class MaskEffect:
    """What a grammar's mask did to one row: what the sampling view draws as its first stage."""

    num_allowed: int  # tokens the grammar allows here
    masked_mass: float  # the model's probability (softmax at T=1, before the mask) on the tokens it removed
    masked_top: list[tuple[int, float]]  # the likeliest removed tokens, (token, the model's p); dist_top_n of them


@dataclass
class RowOutput:
    token_ids: list[int] = field(default_factory=list)  # sample: one per stream; verify: accepted drafts + one
    logprobs: list[float] = field(default_factory=list)  # raw (T=1) log-probability of each of token_ids
    top_logprobs: list[TopLogprobs] | None = None  # per token, when the row's request asks for logprobs
    tops: list[list[list]] | None = None  # per token, [token, raw p, final p] rows of the event's `dist`
    raw_probs: torch.Tensor | None = None  # [len(token_ids), V] kept for the what-if (keep_raw)
    grammar: list[MaskEffect] | None = None  # per token under a grammar
    # verify rows
    num_accepted: int = 0
    source: str = "target"  # of the last token: target | resampled | bonus
    draft_p: list[float] = field(default_factory=list)  # p(x) of each draft under the target
    draft_q: list[float] = field(default_factory=list)  # q(x) of each draft under the proposer
    expected_accept: list[float] = field(default_factory=list)  # sum_x min(p, q) per judged position
    verify_dists: list[list[list]] | None = None  # per position, [token, p, q] rows of spec_verify's `dists`
    # beam rows
    candidates: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), best first
    # A row that could not be sampled (a grammar that allows no token here, logits that are not numbers):
    # why, and nothing else. The scheduler ends that sequence alone; the rest of the batch goes on.
    error: str | None = None


@dataclass
class StepOutput:
    rows: list[RowOutput | None]  # one per StepInput row; None: a prefill chunk that sampled nothing

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows if r is not None)


@dataclass
class DraftOutput:
    """The drafts for each DraftInput row. The proposer's distributions stay in the executor, which
    judges the drafts with them in the next step's verify rows."""

    token_ids: list[list[int]] = field(default_factory=list)  # per row: the drafts (an n-gram lookup may find fewer)
    q_probs: list[list[float]] = field(default_factory=list)  # per row: each draft's probability under the proposer
