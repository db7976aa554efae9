"""The step's update: a StepOutput (the tokens each row drew) becomes request state, events and answers.

Sampled rows append their tokens (an n > 1 request forks its siblings at its first token, each
taking the token of its own stream), beam rows store their candidates until every live beam of the
request has them, verify rows go to the speculative decoder. Sequences change only through the
scheduler's update methods and the request tracker (which appends through the scheduler too).
"""

from __future__ import annotations

from kvscope.backend.engine.beam_search import Choice, Hypothesis, select
from kvscope.backend.engine.request import Request
from kvscope.backend.engine.request_tracker import RequestTracker
from kvscope.backend.engine.scheduler import ScheduledSeq, Scheduler
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.spec_decode import SpecDecoder
from kvscope.backend.engine.step_events import StepEvents
from kvscope.backend.engine.step_output import RowOutput, StepOutput


class OutputProcessor:
    def __init__(self, tracker: RequestTracker, events: StepEvents, scheduler: Scheduler, max_model_len: int,
                 spec: SpecDecoder | None) -> None:
        self.tracker, self.events, self.scheduler, self.spec = tracker, events, scheduler, spec
        self.eos_ids, self.max_model_len = events.eos_ids, max_model_len

    def process(self, batch: list[ScheduledSeq], out: StepOutput, now: float) -> int:
        """Record what the batch computed and append the new tokens; returns how many were appended."""
        sampled: list[tuple[Sequence, RowOutput]] = []
        beams: list[tuple[Sequence, RowOutput]] = []
        verified: list[tuple[ScheduledSeq, RowOutput]] = []
        for item, row in zip(batch, out.rows, strict=True):
            if item.phase == "verify":  # its cache is settled only once the drafts are judged
                verified.append((item, row))
                continue
            self.scheduler.computed(item.seq, item.context_len)
            if row is not None:
                (beams if row.candidates else sampled).append((item.seq, row))
        appended = sum(self._sample_row(seq, row, now) for seq, row in sampled)
        if beams:
            self._beam_rows(beams, now)
        appended += sum(self.spec.apply(item, row, now) for item, row in verified)
        return appended + len(beams)

    def _sample_row(self, seq: Sequence, row: RowOutput, now: float) -> int:
        """Append each stream's token: one, or n at the first token of an n > 1 request (forking the siblings)."""
        seqs = self.tracker.fork_for_n(seq)
        assert len(seqs) == len(row.token_ids), "one drawn token per stream"
        for j, s in enumerate(seqs):
            req = self.tracker.request_of(s)
            alternatives = row.top_logprobs[j] if row.top_logprobs else None
            self.events.token(req, s, row.token_ids[j], row.logprobs[j], row.raw_probs[j] if row.raw_probs is not None
                              else None, row.tops[j] if row.tops else None, alternatives=alternatives,
                              grammar=row.grammar[j] if row.grammar else None)
            self.tracker.append(req, s, row.token_ids[j], row.logprobs[j], now, alternatives)
        return len(seqs)

    # ---- beam search ------------------------------------------------------------------------------

    def _beam_rows(self, pairs: list[tuple[Sequence, RowOutput]], now: float) -> None:
        """Store each beam's candidates; a request whose live beams all have them takes its step."""
        ready: list[Request] = []
        for seq, row in pairs:
            req = self.tracker.request_of(seq)
            req.beam.pending[seq.seq_id] = row.candidates
            if req not in ready and all(s.seq_id in req.beam.pending for s in self.tracker.live(req)):
                ready.append(req)
        for req in ready:
            self._advance_beams(req, now)

    def _advance_beams(self, req: Request, now: float) -> None:
        beam, live = req.beam, self.tracker.live(req)
        candidates = [beam.pending.pop(s.seq_id) for s in live]
        choices, finishing = select([req.cumulative_logprob[s.seq_id] for s in live], candidates, beam.width,
                                    self.eos_ids, not req.params.ignore_eos)
        for c in finishing:
            parent = live[c.parent]
            beam.finished.append(Hypothesis(parent.seq_id, parent.output_token_ids + [c.token_id],
                                            c.cumulative_logprob, "eos"))
        # Fork before anyone appends: a beam chosen twice hands its current tokens to the child.
        kept: list[tuple[Sequence, Choice]] = []
        for c in choices:
            parent = live[c.parent]
            taken = any(c.parent == other.parent for _, other in kept)
            kept.append((self.tracker.fork(req, parent) if taken else parent, c))
        chosen = {c.parent for c in choices}
        for i, seq in enumerate(live):
            if i not in chosen:
                self.tracker.end_seq(req, seq, "pruned")
        for seq, c in kept:
            self.events.token(req, seq, c.token_id, c.logprob, None, None)
            self.tracker.extend(req, seq, c.token_id, c.logprob, now)
        full = any(len(s.output_token_ids) >= req.max_tokens or len(s) >= self.max_model_len for s, _ in kept)
        # At the length limit every kept beam is a hypothesis (the best n are chosen among them all);
        # else with enough hypotheses the rest are dropped. Decided once, before any ends.
        reason = "length" if full else "pruned" if beam.done else None
        if reason is not None:
            for seq, _ in kept:
                self.tracker.end_seq(req, seq, reason)
