"""Speculative decoding: a cheap proposer drafts k tokens, the target checks them all in one forward.

Exactness comes from the acceptance rule (rejection.py, run by the executor): whatever the
proposer's q is, every appended token is distributed exactly as the target would have sampled it.

Two proposers:
- `DraftModelProposer`: a small model with its own KV cache tensors whose blocks come from the
  engine's block manager (so they show in the block pool). Its sequences live in cache namespace 1.
- `NgramProposer`: prompt lookup, no model. q is one-hot on the copied tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvscope.backend.engine.kv_cache import KVCache
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.sampler import sample, uniform
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.scheduler import ScheduledSeq, Scheduler
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.step_input import step_input

DRAFT_NAMESPACE = 1


@dataclass
class Proposal:
    token_ids: list[int]  # the drafted tokens, possibly fewer than asked (none: plain decode)
    q: torch.Tensor | None  # [len(token_ids), V] the distribution each was drawn from; None: one-hot (n-gram)


@dataclass
class SpecRequest:
    """What a proposer needs of one sequence to draft for it."""

    seq: Sequence
    num_tokens: int  # drafts wanted
    params: SamplingParams
    generator: torch.Generator  # the proposer's own, so drafting never shifts the target's draws


@dataclass
class SpecStats:
    """Running totals behind the acceptance rate, alpha and tokens per verify."""

    num_verifies: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_appended: int = 0  # accepted + the resampled or bonus token
    # alpha = E[sum_x min(p(x), q(x))], over the drafted positions the target judged (those up to the
    # first rejection): later ones were drafted after a token the target did not keep.
    alpha_sum: float = 0.0
    num_judged: int = 0

    def record(self, num_proposed: int, num_accepted: int, expected_accept: list[float]) -> None:
        judged = expected_accept[:num_accepted + 1]
        self.num_verifies += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_appended += num_accepted + 1
        self.alpha_sum += sum(judged)
        self.num_judged += len(judged)

    def summary(self) -> dict[str, float]:
        """The metrics event's spec fields."""
        return {"spec_acceptance_rate": self.num_accepted / max(1, self.num_proposed),
                "spec_alpha": self.alpha_sum / max(1, self.num_judged),
                "spec_tokens_per_verify": self.num_appended / max(1, self.num_verifies)}


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens, copy what followed."""

    method = "ngram"

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1) -> None:
        self.vocab_size, self.max_n, self.min_n = vocab_size, max_n, min_n

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        return [self._one(r.seq.token_ids, r.num_tokens) for r in requests]

    def _one(self, tokens: list[int], k: int) -> Proposal:
        return Proposal(lookup(tokens, k, self.max_n, self.min_n), None)  # a copy is certain: q is one-hot

    def release(self, seq: Sequence) -> None:
        """Nothing is held per sequence."""

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Nothing is cached."""

    def sequences(self) -> list[Sequence]:
        return []


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class DraftModelProposer:
    """A small draft model drafting autoregressively over its own paged cache.

    Each target sequence gets a shadow draft sequence (namespace 1) whose blocks come from the
    engine's block manager through the scheduler (which keeps the running sequences' next blocks
    for them, and copies shared blocks before the draft model writes them) and index the draft's KV
    tensors. Before drafting, the shadow catches up on the tokens it has not computed yet (the whole
    prompt the first time, afterwards the last accepted tokens) in one forward; then it drafts one
    token per forward. The shadow changes only through the scheduler's methods.
    """

    method = "draft"

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, eos_ids: list[int],
                 new_seq_id: Callable[[], int]) -> None:
        self.runner, self.scheduler, self.eos_ids = runner, scheduler, eos_ids
        self.block_size = scheduler.blocks.block_size
        self.new_seq_id = new_seq_id
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> draft sequence

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    def shadow(self, seq: Sequence) -> Sequence:
        draft = self.shadows.get(seq.seq_id)
        if draft is None:
            draft = Sequence(self.new_seq_id(), seq.request_id, [], seq.num_prompt_tokens,
                             cache_namespace=DRAFT_NAMESPACE)
            self.shadows[seq.seq_id] = draft
        return draft

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        drafted: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]  # each [V]
        keep_free = self.scheduler.blocks_for_next_decodes()  # drafting changes no target sequence's need
        for round_ in range(max((r.num_tokens for r in requests), default=0)):
            # Rows still drafting: they want more, and no earlier round ran out of blocks for them.
            wanted = [i for i, r in enumerate(requests) if r.num_tokens > round_ and len(drafted[i]) == round_]
            planned = [(i, plan) for i in wanted if (plan := self._schedule(requests[i], round_ == 0, keep_free))]
            if not planned:
                break
            batch = [item for _, (item, _) in planned]
            copies = [pair for _, (_, pairs) in planned for pair in pairs]
            logits = self.runner.logits(step_input(batch, copies, self.block_size))  # [len(batch), V]
            for item in batch:
                self.scheduler.computed(item.seq, item.context_len)
            reqs = [requests[i] for i, _ in planned]
            out = sample(logits, [r.params for r in reqs], [0.0 if r.params.greedy else uniform(r.generator)
                                                            for r in reqs], self.eos_ids,
                         [item.seq.token_ids for item in batch], [item.seq.num_prompt_tokens for item in batch])
            for row, (i, (item, _)) in enumerate(planned):
                self.scheduler.append(item.seq, out.token_ids[row])
                drafted[i].append(out.token_ids[row])
                qs[i].append(out.final_probs[row])
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafted, qs, strict=True)]

    def _schedule(self, request: SpecRequest, first: bool,
                  keep_free: int) -> tuple[ScheduledSeq, list[tuple[int, int]]] | None:
        """The draft forward for one sequence and the block copies it needs first; None when blocks ran out."""
        draft = self.shadow(request.seq)
        if first:  # catch up on the target's tokens, keeping what the draft computed of them
            self.scheduler.sync_draft(draft, request.seq.token_ids)
        num = len(draft) - draft.num_computed_tokens
        copies = self.scheduler.reserve_draft(draft, num, keep_free)
        if copies is None:
            return None
        return ScheduledSeq(draft, num, len(draft), "decode" if num == 1 else "prefill"), copies

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep the draft's K/V for the target's first num_valid tokens, drop the rest (and emptied blocks)."""
        draft = self.shadows.get(seq.seq_id)
        if draft is not None:
            self.scheduler.truncate(draft, min(draft.num_computed_tokens, num_valid))

    def release(self, seq: Sequence) -> None:
        """The target sequence finished or was preempted: its draft gives back every block."""
        draft = self.shadows.pop(seq.seq_id, None)
        if draft is not None:
            self.scheduler.release_draft(draft)

    def sequences(self) -> list[Sequence]:
        return list(self.shadows.values())
