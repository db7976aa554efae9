"""What the model runner computes in one step, as plain data: no Sequence, no Request, no tensor.

The scheduler's entries (ScheduledSeq, which point at live sequences) are flattened here, on the
scheduler's side, into lists of ints that pickle: a runner in another process or on another rank
needs nothing else, and nothing it does can write back into a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.backend.phase import Phase
from kvscope.backend.engine.scheduler import ScheduledSeq


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

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    def num_query(self, row: int) -> int:
        return self.query_starts[row + 1] - self.query_starts[row]


def step_input(batch: list[ScheduledSeq], block_copies: list[tuple[int, int]], block_size: int) -> StepInput:
    """Flatten the scheduled entries (verify entries already hold their drafts) into a StepInput."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    starts = [0]
    for item in batch:
        seq, begin = item.seq, item.context_len - item.num_tokens
        ids += seq.token_ids[begin:item.context_len]
        positions += range(begin, item.context_len)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(begin, item.context_len)]
        if item.phase == "verify":  # every position: each checks the draft that follows it
            logit_rows += range(starts[-1], len(ids))
        elif item.samples:
            logit_rows.append(len(ids) - 1)
        starts.append(len(ids))
    return StepInput(request_ids=[item.seq.request_id for item in batch], seq_ids=[item.seq.seq_id for item in batch],
                     phases=[item.phase for item in batch], query_starts=starts,
                     context_lens=[item.context_len for item in batch],
                     block_tables=[list(item.seq.block_table) for item in batch], input_ids=ids, positions=positions,
                     slot_mapping=slots, logit_rows=logit_rows, block_copies=list(block_copies))
