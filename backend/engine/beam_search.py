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



@dataclass
class Hypothesis:
    seq_id: int  # the beam it came from
    output_token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # eos | length | stop

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(1, len(self.output_token_ids)) ** length_penalty


@dataclass
class BeamChoice:
    parent: int  # index of the beam it extends
    token_id: int
    logprob: float  # of the token alone
    cumulative_logprob: float


@dataclass
class BeamState:
    width: int
    length_penalty: float
    # live seq_id -> its best next tokens (token, logprob), best first: enough for `select`
    pending: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)

    def ranked(self) -> list[Hypothesis]:
        """Finished hypotheses, best first (ties: the earlier found first)."""
        return sorted(self.finished, key=lambda h: -h.score(self.length_penalty))

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.width


def select(cumulative: list[float], best: list[list[tuple[int, float]]], width: int, eos_ids: list[int],
           allow_eos: bool) -> tuple[list[BeamChoice], list[BeamChoice]]:
    """(next beams, EOS candidates that finish), best first, from each beam's best next tokens.

    best[b]: beam b's top `width + len(eos_ids)` (token, logprob) pairs (the executor's `candidates`):
    enough to find `width` non-EOS candidates even when every EOS ranks among them. Ties rank the
    lower beam index, then the lower token id, first, so the search is deterministic.
    """
    candidates = [BeamChoice(b, t, lp, cumulative[b] + lp) for b, pairs in enumerate(best) for t, lp in pairs]
    candidates.sort(key=lambda c: (-c.cumulative_logprob, c.parent, c.token_id))
    beams: list[BeamChoice] = []
    finishing: list[BeamChoice] = []
    for rank, c in enumerate(candidates):
        if len(beams) == width:
            break
        if c.token_id in eos_ids and allow_eos:
            if rank < width:  # an EOS counts only among the top `width`, as in the usual formulation
                finishing.append(c)
            continue
        beams.append(c)
    return beams, finishing
