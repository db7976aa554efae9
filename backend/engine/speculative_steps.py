"""The engine's speculative-decoding steps: draft before the target's forward, judge after it.

A mixin of `Engine` (engine.py), kept apart so that the plain step reads on its own. The proposers
and the acceptance rule live in speculative.py; here they meet the engine's sequences, blocks and
events: drafts go into the sequence for the target to verify in one forward, and after the verdict
the rejected drafts' slots roll back in both caches.
"""

from __future__ import annotations

import torch

from backend.engine.kv_cache import KVCache
from backend.engine.request import RequestError
from backend.engine.runner import ModelRunner
from backend.engine.sampler import distributions, penalised
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.engine.speculative import (DraftModelProposer, NgramProposer, Proposal, SpecRequest, Verdict,
                                        verify)
from backend.model.loader import LoadedModel, ModelLoadError, load_model


class SpeculativeSteps:
    """Engine methods for `engine.speculative` (see docs/speculative.md)."""

    def _make_proposer(self, draft: LoadedModel | None) -> NgramProposer | DraftModelProposer:
        spec = self.config.speculative
        vocab = self.loaded.config.vocab_size
        if spec.method == "ngram":
            return NgramProposer(vocab)
        if draft is None:
            try:
                draft = load_model(spec.draft_model)
            except ModelLoadError as e:
                raise RequestError("engine.speculative.draft_model", str(e)) from None
        if draft.config.vocab_size != vocab:
            raise RequestError("engine.speculative.draft_model",
                               f"its vocabulary has {draft.config.vocab_size} tokens, the target's {vocab}: "
                               "a draft must share the target's tokenizer")
        self.draft = draft
        dtype = next(draft.model.parameters()).dtype
        cache = KVCache(draft.config, self.cache.num_blocks, self.cache.block_size, dtype, self.device,
                        self.config.kv_cache_dtype)
        runner = ModelRunner(draft.model.to(self.device), cache, self.attention_backend)
        return DraftModelProposer(runner, self.blocks, self.eos_ids, self._new_seq_id)

    def _num_draft(self, seq: Sequence) -> int:
        """Drafts worth verifying: never past max_tokens or max_model_len (the +1 is the target's own token)."""
        req = self.unfinished[seq.seq_id]
        left = min(req.max_tokens - len(seq.output_token_ids), self.config.max_model_len - len(seq)) - 1
        return max(0, min(self.config.speculative.num_tokens, left))

    def _draft_header(self) -> dict:
        """The draft model's size and cache, when one runs beside the target."""
        if not isinstance(self.proposer, DraftModelProposer):
            return {}
        c, cache = self.draft.config, self.proposer.cache
        return {"draft_model": {"name": self.config.speculative.draft_model, "n_layers": c.num_hidden_layers,
                                "kv_bytes_per_token": cache.bytes_per_token,
                                "bytes_per_block": cache.bytes_per_block}}

    def _propose(self, items: list[ScheduledSeq]) -> list[Proposal]:
        """Draft for each verifying sequence and put the drafts into its tokens for the target to check."""
        reqs = [self.unfinished[item.seq.seq_id] for item in items]
        proposals = self.proposer.propose([SpecRequest(item.seq, item.num_draft, r.params, r.draft_generator)
                                           for item, r in zip(items, reqs, strict=True)])
        for item, proposal in zip(items, proposals, strict=True):
            seq, drafts = item.seq, proposal.token_ids
            if len(drafts) < item.num_draft:  # the proposer came up short: give back the spare slots
                self._trim(seq, seq.num_computed_tokens + 1 + len(drafts))
            item.num_draft, item.num_tokens = len(drafts), 1 + len(drafts)
            item.context_len = seq.num_computed_tokens + item.num_tokens
            if drafts and self.bus.wants("spec_propose"):
                self.bus.emit("spec_propose", request_id=seq.request_id, seq_id=seq.seq_id, token_ids=drafts,
                              q_probs=proposal.q[range(len(drafts)), drafts].tolist(),
                              method=self.proposer.method, position=len(seq),
                              draft_seq_id=self.proposer.shadows[seq.seq_id].seq_id
                              if isinstance(self.proposer, DraftModelProposer) else None,
                              token_texts=[self.token_text(t) for t in drafts])
            seq.token_ids += drafts
        return proposals

    def _verify_and_append(self, item: ScheduledSeq, proposal: Proposal, logits: torch.Tensor, now: float) -> int:
        """Judge the drafts against the target's k + 1 rows of logits; returns the tokens appended."""
        req, seq, k = self.unfinished[item.seq.seq_id], item.seq, item.num_draft
        start = len(seq) - k  # position of the first draft
        drafts = seq.token_ids[start:]
        # What each row's penalties see: the tokens before it, accepted drafts included.
        prefixes = [seq.token_ids[:start + j] for j in range(k + 1)] if penalised(req.params) else None
        raw_log, _, p = distributions(logits, [req.params] * (k + 1), self.eos_ids, prefixes,
                                      [seq.num_prompt_tokens] * (k + 1))
        verdict = verify(p, proposal.q, drafts, req.generators[seq.seq_id], req.params.greedy)
        del seq.token_ids[start:]
        seq.num_computed_tokens = start + verdict.num_accepted  # the last token and the accepted drafts
        expected = torch.minimum(p[:k], proposal.q).sum(-1).tolist() if k else []
        self.spec_stats.record(k, verdict.num_accepted, expected)
        self._emit_verify(seq, drafts, verdict, p, proposal.q, expected)
        new = drafts[:verdict.num_accepted] + [verdict.token_id]
        sources = ["draft_accepted"] * verdict.num_accepted + [verdict.source]
        logprobs = raw_log[range(len(new)), new].tolist()
        raw = raw_log[:len(new)].exp() if self.bus.wants("token") else None  # only events read it
        tops = self._top_tokens(raw, p[:len(new)], new) if self.bus.wants_dist else None
        for j, (token, source, logprob) in enumerate(zip(new, sources, logprobs, strict=True)):
            if raw is not None:
                self._emit_token(req, seq, token, logprob, raw[j], tops[j] if tops else None, source)
            if self._append(req, seq, token, logprob, now):
                return j + 1
        self._trim(seq, len(seq))
        self.blocks.commit_computed(seq)
        self.proposer.rollback(seq, seq.num_computed_tokens)
        return len(new)

    def _trim(self, seq: Sequence, num_slots: int) -> None:
        """Give back blocks reserved past num_slots (paged only: contiguous keeps its reservation)."""
        if self.config.kv_layout == "paged":
            self.blocks.truncate(seq, num_slots)

    def _emit_verify(self, seq: Sequence, drafts: list[int], verdict: Verdict, p: torch.Tensor, q: torch.Tensor,
                     expected: list[float]) -> None:
        if not self.bus.wants("spec_verify"):
            return
        k = len(drafts)
        p_x, q_x = p[range(k), drafts].tolist(), q[range(k), drafts].tolist()
        results = [{"token_id": t, "text": self.token_text(t), "p": p_x[j], "q": q_x[j],
                    "accepted": verdict.accepted[j]} for j, t in enumerate(drafts)]
        fields = {}
        if self.bus.wants_dist:
            q_full = torch.cat((q, torch.zeros_like(p[:1])))  # [k + 1, V]: the bonus position has no draft
            n = self.config.dist_top_n
            ids = torch.cat((p.topk(n).indices, q_full.topk(n).indices), dim=1)  # [k + 1, 2N]
            p_top, q_top = p.gather(1, ids).tolist(), q_full.gather(1, ids).tolist()
            fields["dists"] = [[[t, self.token_text(t), p_top[j][i], q_top[j][i]]
                                for i, t in enumerate(row) if row.index(t) == i and (p_top[j][i] > 0 or q_top[j][i] > 0)]
                               for j, row in enumerate(ids.tolist())]
        resampled = verdict.source == "resampled"
        self.bus.emit("spec_verify", request_id=seq.request_id, seq_id=seq.seq_id, position=len(seq),
                      results=results, num_accepted=verdict.num_accepted,
                      resampled_token_id=verdict.token_id if resampled else None,
                      bonus_token_id=None if resampled else verdict.token_id, expected_accept=expected, **fields)

