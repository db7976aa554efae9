"""From the runner's logits to token outcomes: sampled tokens, beam steps, speculative verdicts.

Rows of logits follow the batch: one per sequence that samples this step, k + 1 per verify entry.
Sampled rows go through the sampler (each from its sequence's own generator), beam rows through
the beam ranking (beam_search.py), verify rows to the speculative decoder. Tokens are appended
and sequences ended through the request tracker; token events through the step events.
"""

from __future__ import annotations

import torch

from kvscope.backend.engine.beam_search import Choice, Hypothesis, select
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.request import Request
from kvscope.backend.engine.request_output import top_logprobs
from kvscope.backend.engine.request_tracker import RequestTracker
from kvscope.backend.engine.sampler import constrain, sample
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.spec_decode import SpecDecoder, StepBatch
from kvscope.backend.engine.step_events import StepEvents


class OutputProcessor:
    def __init__(self, tracker: RequestTracker, events: StepEvents, blocks: BlockManager, max_model_len: int,
                 spec: SpecDecoder | None) -> None:
        self.tracker, self.events, self.blocks, self.spec = tracker, events, blocks, spec
        self.eos_ids, self.max_model_len = events.eos_ids, max_model_len

    def process(self, batch: StepBatch, logits: torch.Tensor | None, now: float) -> int:
        """Record what the batch computed and append the new tokens; returns how many were appended."""
        sampling: list[tuple[Sequence, int]] = []  # (sequence, its row of logits)
        beams: list[tuple[Sequence, int]] = []
        verify_rows, row = [], 0
        for item in batch.items:
            if item.phase == "verify":  # its cache is settled only once the drafts are judged
                verify_rows.append(logits[row:row + item.num_tokens])
                row += item.num_tokens
                continue
            item.seq.num_computed_tokens = item.context_len
            self.blocks.commit_computed(item.seq)
            if item.samples:
                (beams if self.tracker.request_of(item.seq).beam else sampling).append((item.seq, row))
                row += 1
        sampling = [(sibling, r) for seq, r in sampling for sibling in self.tracker.fork_for_n(seq)]
        if sampling:
            self._sample(sampling, logits, now)
        if beams:
            self._beam_rows(beams, logits, now)
        verifying = [item for item in batch.items if item.phase == "verify"]
        appended = sum(self.spec.verify(item, proposal, rows, now)
                       for item, proposal, rows in zip(verifying, batch.proposals, verify_rows, strict=True))
        return len(sampling) + len(beams) + appended

    def _sample(self, pairs: list[tuple[Sequence, int]], logits: torch.Tensor, now: float) -> None:
        """Draw one token for each (sequence, row of logits), each from the sequence's own generator."""
        seqs = [seq for seq, _ in pairs]
        reqs = [self.tracker.request_of(seq) for seq in seqs]
        result = sample(logits[[r for _, r in pairs]], [r.params for r in reqs],
                        [r.generators[seq.seq_id] for r, seq in zip(reqs, seqs, strict=True)], self.eos_ids,
                        [seq.token_ids for seq in seqs], [seq.num_prompt_tokens for seq in seqs])
        tops = self.events.top_tokens(result.raw_probs, result.final_probs, result.token_ids) \
            if self.events.wants_dist else None
        for row, (req, seq) in enumerate(zip(reqs, seqs, strict=True)):
            token, logprob, raw = result.token_ids[row], result.logprobs[row], result.raw_probs[row]
            alternatives = top_logprobs(raw, req.params.logprobs) if req.params.logprobs else None
            self.events.token(req, seq, token, logprob, raw, tops[row] if tops else None, alternatives=alternatives)
            self.tracker.append(req, seq, token, logprob, now, alternatives)

    # ---- beam search ------------------------------------------------------------------------------

    def _beam_rows(self, pairs: list[tuple[Sequence, int]], logits: torch.Tensor, now: float) -> None:
        """Store each beam's next-token log-probs; a request whose live beams all have them takes its step."""
        ready: list[Request] = []
        for seq, row in pairs:
            req = self.tracker.request_of(seq)
            constrained = constrain(logits[row:row + 1].float(), [req.params])[0]  # logit_bias, allowed_token_ids
            req.beam.pending[seq.seq_id] = torch.log_softmax(constrained, dim=-1)
            if req not in ready and all(s.seq_id in req.beam.pending for s in self.tracker.live(req)):
                ready.append(req)
        for req in ready:
            self._advance_beams(req, now)

    def _advance_beams(self, req: Request, now: float) -> None:
        beam, live = req.beam, self.tracker.live(req)
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
