"""Speculative decoding in the engine's step: drafts proposed in the update, verdicts applied in the next.

The proposers live in speculative.py, the acceptance rule runs in the executor (sample_step.py).
The `SpecDecoder` owns a proposer, and the update's two speculative duties: after a step's tokens
are appended it drafts for every sequence that decodes next (the scheduler holds the drafts, so
its next `schedule` reserves and budgets exactly the verify it will run), and it applies each
verify row's verdict: the accepted tokens are appended, the rejected drafts' slots roll back in
both caches, and the running statistics move.
"""

from __future__ import annotations

from collections.abc import Callable

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.request_tracker import RequestTracker
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.scheduler import Drafts, ScheduledSeq, Scheduler
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.speculative import DraftModelProposer, NgramProposer, SpecRequest, SpecStats
from kvscope.backend.engine.step_events import StepEvents
from kvscope.backend.engine.step_output import RowOutput
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, load_model

Proposer = NgramProposer | DraftModelProposer


class SpecDecoder:
    def __init__(self, proposer: Proposer, config: EngineConfig, scheduler: Scheduler, tracker: RequestTracker,
                 events: StepEvents) -> None:
        self.proposer, self.config, self.scheduler = proposer, config, scheduler
        self.tracker, self.events = tracker, events
        self.stats = SpecStats()

    def num_draft(self, seq: Sequence) -> int:
        """Drafts worth verifying: never past max_tokens or max_model_len (the +1 is the target's own token)."""
        req = self.tracker.request_of(seq)
        left = min(req.max_tokens - len(seq.output_token_ids), self.config.max_model_len - len(seq)) - 1
        return max(0, min(self.config.speculative.num_tokens, left))

    def propose(self) -> None:
        """Draft for every running sequence whose next step is a decode; the scheduler holds the drafts."""
        wanted = [(seq, self.num_draft(seq)) for seq in self.scheduler.running
                  if seq.num_uncomputed_tokens == 1 and seq.output_token_ids]
        decoding = [(seq, k) for seq, k in wanted if k]
        if not decoding:
            return
        reqs = [self.tracker.request_of(seq) for seq, _ in decoding]
        proposals = self.proposer.propose([SpecRequest(seq, k, r.params, r.draft_generator)
                                           for (seq, k), r in zip(decoding, reqs, strict=True)])
        for (seq, _), proposal in zip(decoding, proposals, strict=True):
            draft_seq = self.proposer.shadows[seq.seq_id].seq_id if isinstance(self.proposer, DraftModelProposer) \
                else None
            q_probs = [1.0] * len(proposal.token_ids) if proposal.q is None else \
                proposal.q[range(len(proposal.token_ids)), proposal.token_ids].tolist()
            self.events.spec_propose(seq, proposal.token_ids, q_probs, self.proposer.method, draft_seq)
            self.scheduler.hold_drafts(seq, Drafts(tuple(proposal.token_ids), proposal.q))

    def apply(self, item: ScheduledSeq, row: RowOutput, now: float) -> int:
        """A verify row's verdict: append the accepted drafts and the token after them; returns how many."""
        req, seq, k = self.tracker.request_of(item.seq), item.seq, item.num_draft
        start = len(seq)  # position of the first draft
        drafts = list(item.drafts.token_ids)
        self.stats.record(k, row.num_accepted, row.expected_accept)
        self.events.spec_verify(seq, drafts, row)
        sources = ["draft_accepted"] * row.num_accepted + [row.source]
        for j, (token, source, logprob) in enumerate(zip(row.token_ids, sources, row.logprobs, strict=True)):
            alternatives = row.top_logprobs[j] if row.top_logprobs else None
            self.events.token(req, seq, token, logprob, row.raw_probs[j] if row.raw_probs is not None else None,
                              row.tops[j] if row.tops else None, source, alternatives,
                              row.grammar[j] if row.grammar else None)
            if self.tracker.append(req, seq, token, logprob, now, alternatives):
                return j + 1  # the sequence ended here: its blocks (and its draft's) are gone already
        self.scheduler.computed(seq, start + row.num_accepted)  # the last token and the accepted drafts
        if self.config.kv_layout == "paged":  # give back the rejected drafts' slots (contiguous keeps them)
            self.scheduler.truncate(seq, len(seq))
        self.proposer.rollback(seq, seq.num_computed_tokens)
        return len(row.token_ids)

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


def make_proposer(config: EngineConfig, vocab_size: int, draft: LoadedModel | None, target_cache: KVCache,
                  attention_backend: str, scheduler: Scheduler, eos_ids: list[int],
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
    return DraftModelProposer(runner, scheduler, eos_ids, new_seq_id)
