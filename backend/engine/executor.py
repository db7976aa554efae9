"""The executor: what the engine hands a step's data to, and gets ids back from.

Two calls, each plain data in and out, so that the executor could live in another process:
- `execute(StepInput) -> StepOutput`: the target model's forward over the paged cache (a
  ModelRunner, rank 0 of a tensor-parallel group, or simulate mode's priced stand-in) and its
  sampling (sample_step.py);
- `propose(DraftInput) -> DraftOutput`: speculative decoding's drafts, drawn by a proposer
  (speculative.py) after the step's update, for the next step to verify.
No logits leave it: the proposer's distributions q stay here until the verify rows of the next
`execute` judge the drafts with them (drafts are verified in the next step or never).
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvscope.backend.engine.sample_step import sample_step
from kvscope.backend.engine.speculative import DraftModelProposer, DraftQ, NgramProposer
from kvscope.backend.engine.step_input import DraftInput, StepInput
from kvscope.backend.engine.step_output import DraftOutput, StepOutput

Proposer = NgramProposer | DraftModelProposer


class Forward(Protocol):
    """A runner: the model's logits for a StepInput (runner.ModelRunner and the runners that stand in for it)."""

    def logits(self, inp: StepInput) -> torch.Tensor: ...


class Executor:
    def __init__(self, runner: Forward, proposer: Proposer | None = None) -> None:
        self.runner, self.proposer = runner, proposer
        self._draft_q: DraftQ = {}  # target seq_id -> [k, V], from the last `propose`

    def execute(self, inp: StepInput) -> StepOutput:
        """One iteration's forward, sampled: the tokens each row drew, verified or ranked."""
        draft_q, self._draft_q = self._draft_q, {}
        return sample_step(self.runner.logits(inp), inp, draft_q)

    def propose(self, inp: DraftInput) -> DraftOutput:
        """Drafts for the next step; the proposer's distributions are kept for its verify rows."""
        assert self.proposer is not None, "propose needs engine.speculative"
        out, self._draft_q = self.proposer.propose(inp)
        return out
