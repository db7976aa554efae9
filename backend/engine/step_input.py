"""What the executor computes and samples in one step, as plain data: no Sequence, no Request.

The scheduler's entries (ScheduledSeq, which point at live sequences) are flattened here, on the
scheduler's side, into lists of ints that pickle, with each sampling row's settings and random
numbers (`RowSampling`): an executor in another process or on another rank needs nothing else,
and nothing it does can write back into a sequence. Its answer is a StepOutput (step_output.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvscope.backend.engine.grammar import Matcher
from kvscope.backend.engine.request import Request
from kvscope.backend.engine.sampler import penalised, uniform
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.scheduler import ScheduledSeq
from kvscope.backend.phase import Phase


@dataclass(frozen=True)
class RowSampling:
    """How one row's logits become tokens: the request's settings and the random numbers it may use."""

    kind: Literal["sample", "verify", "beam"]
    params: SamplingParams
    # sample: one per stream (n at the first token of an n > 1 request, else one); verify: k + 1 (the
    # accept tests, then the token after them); none when greedy or beam. Drawn from the sequences'
    # own generators by the scheduler's side, so the executor holds no random state.
    uniforms: list[float] = field(default_factory=list)
    streams: int = 1  # sample: tokens drawn from this row, one per stream
    history: list[int] | None = None  # prompt + output before the row's first query token, when penalised
    prompt_len: int = 0  # where the output starts in history
    drafts: list[int] = field(default_factory=list)  # verify: the drafted tokens, the row's last k queries
    draft_q: torch.Tensor | None = None  # verify: [k, V] the proposer's distributions; None: one-hot (n-gram)
    beam_top: int = 0  # beam: candidates to hand back (beam_search.select needs width + len(eos) per beam)
    # structured outputs: the grammar's packed masks, int32 [1 (sample) or k + 1 (verify), ceil(V / 32)];
    # filled from the sequence's matcher here, on the scheduler's side, which alone holds grammar state
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class StepInput:
    # one entry per scheduled sequence (a row), in batch order
    request_ids: list[str]
    seq_ids: list[int]
    phases: list[Phase]  # phase.py
    query_starts: list[int]  # [rows + 1] where each row's query tokens start in the flat lists below
    context_lens: list[int]  # keys each row attends to (cached + new)
    block_tables: list[list[int]]  # [rows][blocks] physical block ids
    # one entry per query token, rows side by side
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # block_id * block_size + offset: where each token's K/V is written
    logit_rows: list[int]  # the query tokens whose logits come back: a sampling row's last, every verify position
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst), done before the forward
    # one entry per row: how its logits become tokens; None for a prefill chunk that samples nothing
    sampling: list[RowSampling | None] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    # what observers want back (step_output.py): top-N distribution rows per token (0: none), whole raw rows
    dist_top_n: int = 0
    keep_raw: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def num_query(self, row: int) -> int:
        return self.query_starts[row + 1] - self.query_starts[row]


def step_input(batch: list[ScheduledSeq], block_copies: list[tuple[int, int]], block_size: int,
               sampling: list[RowSampling | None] | None = None, eos_ids: list[int] | None = None,
               dist_top_n: int = 0, keep_raw: bool = False) -> StepInput:
    """Flatten the scheduled entries (verify entries already hold their drafts) into a StepInput.

    sampling: per entry (`row_sampling`); without it the step only computes logits (a draft model's)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    starts = [0]
    for item in batch:
        seq, begin = item.seq, item.context_len - item.num_tokens
        ids += seq.token_ids[begin:item.context_len - item.num_draft]
        positions += range(begin, item.context_len)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(begin, item.context_len)]
        if item.drafts:  # the drafts are fed after the sequence's last token; they are not its tokens yet
            ids += item.drafts.token_ids
        if item.phase == "verify":  # every position: each checks the draft that follows it
            logit_rows += range(starts[-1], len(ids))
        elif item.samples:
            logit_rows.append(len(ids) - 1)
        starts.append(len(ids))
    return StepInput(request_ids=[item.seq.request_id for item in batch], seq_ids=[item.seq.seq_id for item in batch],
                     phases=[item.phase for item in batch], query_starts=starts,
                     context_lens=[item.context_len for item in batch],
                     block_tables=[list(item.seq.block_table) for item in batch], input_ids=ids, positions=positions,
                     slot_mapping=slots, logit_rows=logit_rows, block_copies=list(block_copies),
                     sampling=list(sampling or []), eos_ids=list(eos_ids or []), dist_top_n=dist_top_n,
                     keep_raw=keep_raw)


def row_sampling(item: ScheduledSeq, req: Request, eos_ids: list[int],
                 matcher: Matcher | None = None) -> RowSampling | None:
    """How the entry's logits become tokens, with the uniforms drawn now from its streams' generators.

    matcher: the sequence's grammar (structured outputs), whose masks the row carries."""
    seq, params = item.seq, req.params
    history = list(seq.token_ids) if penalised(params) else None
    if item.drafts:
        streams = [req.streams[seq.seq_id]] * (item.num_draft + 1)
        drafts = list(item.drafts.token_ids)
        return RowSampling("verify", params, _uniforms(req, streams), history=history,
                           prompt_len=seq.num_prompt_tokens, drafts=drafts, draft_q=item.drafts.q,
                           allowed=matcher.masks(drafts) if matcher else None)
    if not item.samples:
        return None
    if req.beam is not None:
        return RowSampling("beam", params, beam_top=req.beam.width + len(eos_ids))
    # n > 1: the first token is drawn n times from the same logits, stream i for the sibling forked i-th.
    first_of_n = params.n > 1 and len(req.seqs) == 1 and not seq.output_token_ids
    streams = list(range(params.n)) if first_of_n else [req.streams[seq.seq_id]]
    return RowSampling("sample", params, _uniforms(req, streams), streams=len(streams), history=history,
                       prompt_len=seq.num_prompt_tokens, allowed=matcher.masks([]) if matcher else None)


def _uniforms(req: Request, streams: list[int]) -> list[float]:
    return [] if req.params.greedy else [uniform(req.generator(s)) for s in streams]
