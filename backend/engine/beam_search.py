"""Beam search over the paged cache: which beams live on, which fork, which end.

Each step every live beam has the model's log-probabilities for its next token. All (beam, token)
candidates are ranked by cumulative log-probability; an EOS candidate among the top `width`
becomes a finished hypothesis, the best non-EOS candidates become the next beams. A beam chosen
twice forks (its blocks are shared, copy-on-write), a beam not chosen is pruned (its blocks freed).
Finished hypotheses are ranked by cumulative log-prob / length ** length_penalty. The search ends
when `width` hypotheses are finished (transformers' early_stopping=True) or the beams reach
max_tokens: then every beam kept at that step is a hypothesis too, and the best n of all are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Hypothesis:
    seq_id: int  # the beam it came from
    output_token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # eos | length | stop

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(1, len(self.output_token_ids)) ** length_penalty


@dataclass
class Choice:
    parent: int  # index of the beam it extends
    token_id: int
    logprob: float  # of the token alone
    cumulative_logprob: float


@dataclass
class BeamState:
    width: int
    length_penalty: float
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # live seq_id -> next-token log-probs [V]
    finished: list[Hypothesis] = field(default_factory=list)

    def ranked(self) -> list[Hypothesis]:
        """Finished hypotheses, best first (ties: the earlier found first)."""
        return sorted(self.finished, key=lambda h: -h.score(self.length_penalty))

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.width


def select(cumulative: list[float], logprobs: torch.Tensor, width: int, eos_ids: list[int],
           allow_eos: bool) -> tuple[list[Choice], list[Choice]]:
    """(next beams, EOS candidates that finish) from log-probs [num_beams, V], best first.

    Ties rank the lower beam index, then the lower token id, first, so the search is deterministic.
    """
    per_beam = min(logprobs.shape[1], width + len(eos_ids))  # enough to find `width` non-EOS candidates
    top = logprobs.topk(per_beam, dim=-1)
    candidates = [Choice(b, t, lp, cumulative[b] + lp)
                  for b, (tokens, lps) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                  for t, lp in zip(tokens, lps, strict=True)]
    candidates.sort(key=lambda c: (-c.cumulative_logprob, c.parent, c.token_id))
    beams: list[Choice] = []
    finishing: list[Choice] = []
    for rank, c in enumerate(candidates):
        if len(beams) == width:
            break
        if c.token_id in eos_ids and allow_eos:
            if rank < width:  # an EOS counts only among the top `width`, as in the usual formulation
                finishing.append(c)
            continue
        beams.append(c)
    return beams, finishing
