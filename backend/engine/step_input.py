"""What the executor computes and samples, as plain data: no Sequence, no Request.

The scheduler flattens its decision (scheduler_output.py) into lists of ints that pickle, with each
sampling row's settings and random numbers (`RowSampling`): an executor in another process or on
another rank needs nothing else, and nothing it does can write back into a sequence. Its answer is
a StepOutput (step_output.py). `DraftInput` is the same for the draft pass of speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvscope.backend.engine.sampling_params import SamplingParams
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
    # verify: the drafted tokens, the row's last k queries; the executor kept the proposer's distribution
    # of each (Executor.propose), so none travels here
    drafts: list[int] = field(default_factory=list)
    beam_top: int = 0  # beam: candidates to hand back (beam_search.select needs width + len(eos) per beam)
    # structured outputs: the grammar's packed masks, int32 [1 (sample) or k + 1 (verify), ceil(V / 32)];
    # filled from the sequence's matcher by the scheduler, which alone holds grammar state
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


@dataclass(frozen=True)
class RowTokens:
    """One row's query before flattening: its tokens (drafts last), where they start, its blocks."""

    request_id: str
    seq_id: int
    phase: Phase
    token_ids: list[int]  # the query tokens: a chunk of the sequence, then its drafts
    start: int  # position of token_ids[0]
    block_table: list[int]
    num_draft: int = 0
    samples: bool = False  # the row reaches the sequence's last token: its logits come back


def step_input(rows: list[RowTokens], block_copies: list[tuple[int, int]], block_size: int,
               sampling: list[RowSampling | None] | None = None, eos_ids: list[int] | None = None,
               dist_top_n: int = 0, keep_raw: bool = False) -> StepInput:
    """Flatten the rows into a StepInput. sampling: per row; without it the step only computes logits
    (the draft model's forwards)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    starts = [0]
    for row in rows:
        end = row.start + len(row.token_ids)
        ids += row.token_ids
        positions += range(row.start, end)
        slots += [row.block_table[p // block_size] * block_size + p % block_size for p in range(row.start, end)]
        if row.num_draft:  # every position: each checks the draft that follows it
            logit_rows += range(starts[-1], len(ids))
        elif row.samples:
            logit_rows.append(len(ids) - 1)
        starts.append(len(ids))
    return StepInput(request_ids=[r.request_id for r in rows], seq_ids=[r.seq_id for r in rows],
                     phases=[r.phase for r in rows], query_starts=starts,
                     context_lens=[r.start + len(r.token_ids) for r in rows],
                     block_tables=[r.block_table for r in rows], input_ids=ids, positions=positions,
                     slot_mapping=slots, logit_rows=logit_rows, block_copies=list(block_copies),
                     sampling=list(sampling or []), eos_ids=list(eos_ids or []), dist_top_n=dist_top_n,
                     keep_raw=keep_raw)


def token_inputs(inp: StepInput, block_size: int) -> list[StepInput]:
    """The step's forward as one StepInput per query token, in batch order (batch-invariant mode, runner.py).

    Each attends to exactly its own context (a block table no longer than that context), so its kernels see
    the same shapes whatever else was scheduled with it: a prefill chunk, a decode step, a recompute after
    preemption or a prefix-cache hit all compute a token alike. A row's tokens stay in order, each writing its
    K/V before the next reads it. The block copies go with the first; nothing samples here."""
    out, sampled = [], set(inp.logit_rows)
    for row in range(inp.num_rows):
        for t in range(inp.query_starts[row], inp.query_starts[row + 1]):
            context = inp.positions[t] + 1
            out.append(StepInput(
                request_ids=[inp.request_ids[row]], seq_ids=[inp.seq_ids[row]], phases=[inp.phases[row]],
                query_starts=[0, 1], context_lens=[context],
                block_tables=[inp.block_tables[row][:-(-context // block_size)]],
                input_ids=[inp.input_ids[t]], positions=[inp.positions[t]], slot_mapping=[inp.slot_mapping[t]],
                logit_rows=[0] if t in sampled else [], block_copies=[] if out else list(inp.block_copies)))
    return out


# ---- the draft pass of speculative decoding -------------------------------------------------------

@dataclass(frozen=True)
class DraftRow:
    """What a proposer needs to draft for one target sequence."""

    request_id: str
    seq_id: int  # the target sequence the drafts are for
    num_drafts: int  # k
    params: SamplingParams
    uniforms: list[float]  # k draws from the request's own draft stream; none when greedy
    token_ids: list[int]  # the target's tokens (n-gram lookup reads them, and penalties)
    prompt_len: int
    # A draft model's own sequence: it first catches up on the target's tokens it has not computed
    # (token_ids[start:]: the whole prompt the first time, later the tokens accepted since), then
    # drafts one token per forward. Its blocks cover every slot it writes: start .. len + k - 1.
    draft_seq_id: int | None = None
    start: int = 0
    block_table: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DraftInput:
    rows: list[DraftRow] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write of the draft's blocks
    eos_ids: list[int] = field(default_factory=list)
