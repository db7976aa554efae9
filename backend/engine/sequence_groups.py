"""The engine's steps for requests with several sequences: n > 1 siblings and beam search.

A mixin of `Engine` (engine.py). Siblings and beams are plain sequences that share blocks through
`BlockManager.fork`; what is particular to them is here: when they fork, how beams advance and are
pruned (the ranking itself is in beam_search.py), and how a request ends with its last sequence.
"""

from __future__ import annotations

import time

import torch

from backend.engine.beam_search import Choice, Hypothesis, select
from backend.engine.request import Request
from backend.engine.sequence import Sequence, SeqStatus


class SequenceGroups:
    """Engine methods for `sampling.n` and `sampling.beam_width` (see docs/engine.md)."""

    def _fork_for_n(self, seq: Sequence, row: int) -> list[tuple[Sequence, int]]:
        """n > 1: right after the prompt, fork n - 1 siblings that draw their first token from the same row."""
        req = self.unfinished[seq.seq_id]
        if req.params.n == 1 or len(req.seqs) > 1 or seq.output_token_ids:
            return [(seq, row)]
        return [(seq, row)] + [(self._fork(req, seq), row) for _ in range(req.params.n - 1)]

    def _fork(self, req: Request, parent: Sequence) -> Sequence:
        """A new sequence of the request sharing every block of the parent (copy-on-write on divergence)."""
        child = Sequence(self._new_seq_id(), req.request_id, list(parent.token_ids), parent.num_prompt_tokens)
        self.bus.emit("seq_fork", request_id=req.request_id, parent_seq_id=parent.seq_id, seq_id=child.seq_id,
                      position=len(parent))
        self.blocks.fork(parent, child)
        child.status = parent.status
        if parent.status == SeqStatus.RUNNING:
            self.scheduler.running.append(child)
        else:  # a beam preempted while it waited for its siblings: the child recomputes too
            self.scheduler.waiting.appendleft(child)
        req.seqs.append(child)
        req.add_stream(child)
        req.cumulative_logprob[child.seq_id] = req.cumulative_logprob[parent.seq_id]
        self.unfinished[child.seq_id] = req
        return child

    def _beam_search_step(self, pairs: list[tuple[Sequence, int]], logits: torch.Tensor, now: float) -> None:
        """Store each beam's next-token log-probs; a request whose live beams all have them takes its step."""
        ready: list[Request] = []
        for seq, row in pairs:
            req = self.unfinished[seq.seq_id]
            req.beam.pending[seq.seq_id] = torch.log_softmax(logits[row].float(), dim=-1)
            if req not in ready and all(s.seq_id in req.beam.pending for s in self._live(req)):
                ready.append(req)
        for req in ready:
            self._advance_beams(req, now)

    def _live(self, req: Request) -> list[Sequence]:
        return [s for s in req.seqs if s.seq_id in self.unfinished]

    def _advance_beams(self, req: Request, now: float) -> None:
        beam, live = req.beam, self._live(req)
        logprobs = torch.stack([beam.pending.pop(s.seq_id) for s in live])  # [beams, V]
        choices, finishing = select([req.cumulative_logprob[s.seq_id] for s in live], logprobs, beam.width,
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
            kept.append((self._fork(req, parent) if taken else parent, c))
        chosen = {c.parent for c in choices}
        for i, seq in enumerate(live):
            if i not in chosen:
                self._end_seq(req, seq, "pruned")
        for seq, c in kept:
            self._emit_token(req, seq, c.token_id, c.logprob, None, None)
            self._extend(req, seq, c.token_id, c.logprob, now)
        full = any(len(s.output_token_ids) >= req.max_tokens or len(s) >= self.config.max_model_len for s, _ in kept)
        # At the length limit every kept beam is a hypothesis (the best n are chosen among them all);
        # else with enough hypotheses the rest are dropped. Decided once, before any ends.
        reason = "length" if full else "pruned" if beam.done else None
        if reason is not None:
            for seq, _ in kept:
                self._end_seq(req, seq, reason)

    def _end_seq(self, req: Request, seq: Sequence, reason: str) -> None:
        """One sequence ends: its blocks go back; the request ends with its last sequence."""
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        if self.proposer:
            self.proposer.release(seq)
        self.unfinished.pop(seq.seq_id, None)
        req.seq_finish[seq.seq_id] = reason
        if reason == "pruned":
            req.seqs.remove(seq)  # a pruned beam returns nothing: keeps _live short as beams fork every step
        elif req.beam is not None:
            req.beam.finished.append(Hypothesis(seq.seq_id, seq.output_token_ids, req.cumulative_logprob[seq.seq_id],
                                                reason))
        if req.multi:
            self.bus.emit("seq_end", request_id=req.request_id, seq_id=seq.seq_id, reason=reason)
        if not self._live(req):
            self._finish_request(req)

    def _abort_request(self, req: Request, why: str) -> None:
        """End the whole request: every live sequence with it."""
        req.abort_reason = why
        for seq in self._live(req):
            self._end_seq(req, seq, "abort")

    def _finish_request(self, req: Request) -> None:
        req.outputs = outputs = self._outputs(req)
        best = outputs[0]
        # An aborted request says so, even if one of its beams had already found EOS.
        req.finish_reason = "abort" if req.abort_reason is not None else best["finish_reason"]
        req.output_text = best["output_text"]
        req.times.finish = time.perf_counter()
        t = req.times
        self.bus.emit("request_finished", request_id=req.request_id, seq_id=best["seq_id"],
                      finish_reason=req.finish_reason, reason=req.abort_reason,
                      output_token_ids=best["output_token_ids"], output_text=req.output_text,
                      ttft_s=t.ttft(), tpot_s=t.tpot(), e2e_s=t.e2e(),
                      num_cached_prompt_tokens=req.seq.num_cached_prompt_tokens,
                      **({"outputs": outputs} if req.multi else {}))

    def _outputs(self, req: Request) -> list[dict]:
        """What the request returns: its sequences (n > 1, in order) or its best hypotheses (beam search)."""
        if req.beam is not None and req.beam.finished:
            return [{"seq_id": h.seq_id, "output_token_ids": h.output_token_ids, "finish_reason": h.finish_reason,
                     "output_text": self.tokenizer.decode([t for t in h.output_token_ids if t not in self.eos_ids]),
                     "cumulative_logprob": h.cumulative_logprob, "score": h.score(req.beam.length_penalty)}
                    for h in req.beam.ranked()[:req.params.n]]
        return [{"seq_id": s.seq_id, "output_token_ids": s.output_token_ids, "finish_reason": req.seq_finish[s.seq_id],
                 "output_text": req.output_text_of(s, self.tokenizer, self.eos_ids),
                 "cumulative_logprob": req.cumulative_logprob[s.seq_id], "score": None}
                for s in req.seqs]

