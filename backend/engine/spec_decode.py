"""Speculative decoding in the engine's step: drafts before the target's forward, verdicts after it.

The proposers and the acceptance rule live in speculative.py; the `SpecDecoder` owns a proposer,
the verification of its drafts against the target's logits and the running statistics. Drafts
become a new batch for the runner (the scheduler's output is never edited); after the verdict the
rejected drafts' slots roll back in both caches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.request_output import top_logprobs
from kvscope.backend.engine.request_tracker import RequestTracker
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.sampler import distributions, penalised
from kvscope.backend.engine.scheduler import ScheduledSeq
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.speculative import DraftModelProposer, NgramProposer, Proposal, SpecRequest, SpecStats, verify
from kvscope.backend.engine.step_events import StepEvents
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, load_model

Proposer = NgramProposer | DraftModelProposer


@dataclass(frozen=True)
class StepBatch:
    """What the runner computes this step: the scheduled sequences, verify entries sized to their drafts."""

    items: list[ScheduledSeq]
    proposals: list[Proposal]  # one per verify entry, in batch order

    @property
    def num_prefill_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if i.phase == "prefill")


class SpecDecoder:
    def __init__(self, proposer: Proposer, config: EngineConfig, blocks: BlockManager, tracker: RequestTracker,
                 events: StepEvents) -> None:
        self.proposer, self.config, self.blocks, self.tracker, self.events = proposer, config, blocks, tracker, events
        self.stats = SpecStats()

    def num_draft(self, seq: Sequence) -> int:
        """Drafts worth verifying: never past max_tokens or max_model_len (the +1 is the target's own token)."""
        req = self.tracker.request_of(seq)
        left = min(req.max_tokens - len(seq.output_token_ids), self.config.max_model_len - len(seq)) - 1
        return max(0, min(self.config.speculative.num_tokens, left))

    def propose(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        """Draft for each verifying sequence; the drafts go into its tokens for the target to check."""
        verifying = [item for item in scheduled if item.phase == "verify"]
        if not verifying:
            return StepBatch(scheduled, [])
        reqs = [self.tracker.request_of(item.seq) for item in verifying]
        proposals = self.proposer.propose([SpecRequest(item.seq, item.num_draft, r.params, r.draft_generator)
                                           for item, r in zip(verifying, reqs, strict=True)])
        sized = {id(item): self._drafted(item, p) for item, p in zip(verifying, proposals, strict=True)}
        return StepBatch([sized.get(id(item), item) for item in scheduled], proposals)

    def _drafted(self, item: ScheduledSeq, proposal: Proposal) -> ScheduledSeq:
        """The verify entry for the drafts the proposer really made (it may come up short)."""
        seq, drafts = item.seq, proposal.token_ids
        if len(drafts) < item.num_draft:  # give back the spare slots
            self._trim(seq, seq.num_computed_tokens + 1 + len(drafts))
        draft_seq = self.proposer.shadows[seq.seq_id].seq_id if isinstance(self.proposer, DraftModelProposer) else None
        self.events.spec_propose(seq, drafts, proposal.q, self.proposer.method, draft_seq)
        seq.token_ids += drafts
        return dataclasses.replace(item, num_tokens=1 + len(drafts), num_draft=len(drafts),
                                   context_len=seq.num_computed_tokens + 1 + len(drafts))

    def verify(self, item: ScheduledSeq, proposal: Proposal, logits: torch.Tensor, now: float) -> int:
        """Judge the drafts against the target's k + 1 rows of logits; returns the tokens appended."""
        req, seq, k = self.tracker.request_of(item.seq), item.seq, item.num_draft
        start = len(seq) - k  # position of the first draft
        drafts = seq.token_ids[start:]
        # What each row's penalties see: the tokens before it, accepted drafts included.
        prefixes = [seq.token_ids[:start + j] for j in range(k + 1)] if penalised(req.params) else None
        raw_log, _, p = distributions(logits, [req.params] * (k + 1), self.events.eos_ids, prefixes,
                                      [seq.num_prompt_tokens] * (k + 1))
        verdict = verify(p, proposal.q, drafts, req.generators[seq.seq_id], req.params.greedy)
        del seq.token_ids[start:]
        seq.num_computed_tokens = start + verdict.num_accepted  # the last token and the accepted drafts
        expected = torch.minimum(p[:k], proposal.q).sum(-1).tolist() if k else []
        self.stats.record(k, verdict.num_accepted, expected)
        self.events.spec_verify(seq, drafts, verdict, p, proposal.q, expected)
        new = drafts[:verdict.num_accepted] + [verdict.token_id]
        sources = ["draft_accepted"] * verdict.num_accepted + [verdict.source]
        logprobs = raw_log[range(len(new)), new].tolist()
        asks = req.params.logprobs  # top_logprobs, for the request's answer
        raw = raw_log[:len(new)].exp() if self.events.wants("token") or asks else None
        tops = self.events.top_tokens(raw, p[:len(new)], new) if self.events.wants_dist else None
        for j, (token, source, logprob) in enumerate(zip(new, sources, logprobs, strict=True)):
            alternatives = top_logprobs(raw[j], asks) if asks else None
            if raw is not None:
                self.events.token(req, seq, token, logprob, raw[j], tops[j] if tops else None, source, alternatives)
            if self.tracker.append(req, seq, token, logprob, now, alternatives):
                return j + 1
        self._trim(seq, len(seq))
        self.blocks.commit_computed(seq)
        self.proposer.rollback(seq, seq.num_computed_tokens)
        return len(new)

    def release(self, seq: Sequence) -> None:
        """The target sequence ended or was preempted: its draft state goes (it recomputes from the target's tokens)."""
        self.proposer.release(seq)

    def sequences(self) -> list[Sequence]:
        return self.proposer.sequences()

    def header(self) -> dict:
        """The draft model's size and cache, when one runs beside the target."""
        if not isinstance(self.proposer, DraftModelProposer):
            return {}
        c, cache = self.proposer.runner.model.config, self.proposer.cache
        return {"draft_model": {"name": self.config.speculative.draft_model, "n_layers": c.num_hidden_layers,
                                "kv_bytes_per_token": cache.bytes_per_token, "bytes_per_block": cache.bytes_per_block}}

    def _trim(self, seq: Sequence, num_slots: int) -> None:
        """Give back blocks reserved past num_slots (paged only: contiguous keeps its reservation)."""
        if self.config.kv_layout == "paged":
            self.blocks.truncate(seq, num_slots)


def make_proposer(config: EngineConfig, vocab_size: int, draft: LoadedModel | None, target_cache: KVCache,
                  attention_backend: str, blocks: BlockManager, eos_ids: list[int],
                  new_seq_id: Callable[[], int], load: Callable[[str], LoadedModel] = load_model) -> Proposer:
    """The proposer `engine.speculative` asks for; a draft model gets its own KV tensors over the shared blocks.

    `draft` None: `load` reads the draft model (a server's shared copy, or a fresh one)."""
    spec = config.speculative
    if spec.method == "ngram":
        return NgramProposer(vocab_size)
    if draft is None:
        try:
            draft = load(spec.draft_model)
        except ModelLoadError as e:
            raise RequestError("engine.speculative.draft_model", str(e)) from None
    if draft.config.vocab_size != vocab_size:
        raise RequestError("engine.speculative.draft_model",
                           f"its vocabulary has {draft.config.vocab_size} tokens, the target's {vocab_size}: "
                           "a draft must share the target's tokenizer")
    device = target_cache.data.device
    cache = KVCache(draft.config, target_cache.num_blocks, target_cache.block_size,
                    next(draft.model.parameters()).dtype, device, config.kv_cache_dtype)
    runner = ModelRunner(draft.model.to(device), cache, attention_backend)
    return DraftModelProposer(runner, blocks, eos_ids, new_seq_id)
