"""The scheduler's decision for one step, as ids and ints (vLLM's SchedulerOutput, in spirit).

No sequence, no request, no object of the scheduler's: who runs, with how many tokens, and the block
copies to make first. The scheduler builds the executor's full input from it (`Scheduler.step_input`),
takes it back with the executor's answer (`Scheduler.update_from_output`), and the iteration event
is written from it. Frozen: later stages build new data, they never edit a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.backend.engine.request_output import EngineOutput
from kvscope.backend.phase import Phase


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    seq_id: int
    phase: Phase  # phase.phase_of: the one rule
    num_tokens: int  # query tokens computed this iteration (a verify's drafts included)
    context_len: int  # tokens in the cache after this iteration (keys attended to)
    samples: bool  # the iteration reaches the sequence's last token, so a new token is drawn
    drafts: tuple[int, ...] = ()  # verify: the drafted tokens, the last of the query tokens

    @property
    def num_draft(self) -> int:
        return len(self.drafts)


@dataclass(frozen=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    num_running: int = 0  # sequences running and waiting once this step was scheduled
    num_waiting: int = 0
    num_blocks_used: int = 0
    outputs: list[EngineOutput] = field(default_factory=list)  # what scheduling did: block changes, preemptions, aborts

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if r.phase == "prefill")
