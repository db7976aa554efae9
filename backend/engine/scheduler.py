"""Which sequences run in the next iteration, and with how many tokens each.

Continuous batching, first come first served: each iteration has a token budget and a cap on
running sequences. Running sequences go first (decodes, then the rest of chunked prefills), then
waiting ones are admitted while budget, slots and blocks last. When blocks run out, the most
recently arrived running sequence is preempted by recompute: its blocks are freed and it goes back
to the front of the queue. `static` batching admits a new batch only when the last one has fully
finished, as servers did before continuous batching.

The scheduler is also the only writer of a sequence's state (its tokens, how many are computed, its
status): the step's update stage (output_processor.py, spec_decode.py) and the draft proposer
change a sequence only through the methods under "update", and tests/test_one_writer.py fails
when any other module assigns those fields. Speculative drafts for the next step are proposed in
the update and held here (`drafts`), so `schedule` knows each verify's size before it reserves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.sequence import Sequence, SeqStatus
from kvscope.backend.phase import Phase


@dataclass(frozen=True)
class Drafts:
    """Tokens a proposer drafted for a sequence's next step, and the distribution each came from."""

    token_ids: tuple[int, ...]
    q: torch.Tensor | None  # [k, V] the draft model's distributions; None: one-hot (n-gram lookup)


@dataclass(frozen=True)  # the scheduler's decision: later stages build new entries, never edit one
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # query tokens computed this iteration
    context_len: int  # tokens in the cache after this iteration (keys attended to)
    phase: Phase  # phase.py: prefill | decode | verify (the last token plus drafted ones)
    drafts: Drafts | None = None  # verify: the drafted tokens, the last of the query tokens

    @property
    def num_draft(self) -> int:
        return len(self.drafts.token_ids) if self.drafts else 0

    @property
    def samples(self) -> bool:
        """Whether this iteration reaches the sequence's last token, so a new token is drawn."""
        return self.context_len == len(self.seq) + self.num_draft


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.phase == "prefill")


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager,
                 on_preempt: Callable[[Sequence, int], None]) -> None:
        self.config = config
        self.blocks = blocks
        self.on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.drafts: dict[int, Drafts] = {}  # seq_id -> drafts proposed for its next decode
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_forked(self, child: Sequence, parent: Sequence) -> None:
        """A sequence forked from `parent` (n > 1, beam search) queues where its parent is, sharing its blocks."""
        self.blocks.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = parent.status
        if parent.status == SeqStatus.RUNNING:
            self.running.append(child)
        else:  # a beam preempted while it waited for its siblings: the child recomputes too
            self.waiting.appendleft(child)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its blocks."""
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.drafts.pop(seq.seq_id, None)
        self._free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if self._may_admit():
            self._admit_waiting(out, budget)
        idle = [seq for seq in self.running if seq.num_uncomputed_tokens == 0]
        if not out.scheduled and self.waiting and idle:
            # Every running sequence is a beam waiting for a sibling that waits for blocks: make room.
            # The preempted beam keeps its next-token log-probs (only its cache is recomputed later),
            # so it queues behind the sibling that needs the blocks now.
            self._preempt(max(idle, key=lambda s: s.seq_id), front=False)
            self._admit_waiting(out, budget)
        return out

    # ---- running sequences ----------------------------------------------------------------------

    def _entry(self, seq: Sequence, num: int, drafts: Drafts | None = None) -> ScheduledSeq:
        if drafts:
            k = len(drafts.token_ids)
            return ScheduledSeq(seq, num + k, seq.num_computed_tokens + num + k, "verify", drafts)
        context_len = seq.num_computed_tokens + num
        # Decode: the step that extends an already generating sequence by its newest token (without
        # a cache that step recomputes everything, but it is still the decode of one new token).
        generating = bool(seq.output_token_ids) and context_len == len(seq)
        decode = generating and (num == 1 or not self.config.kv_cache)
        return ScheduledSeq(seq, num, context_len, "decode" if decode else "prefill")

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        idle: list[Sequence] = []  # beams whose logits are in, waiting for their siblings
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not self.config.kv_cache:
                # No KV cache: nothing computed survives a step, the whole sequence is recomputed (O(n^2)).
                seq.num_computed_tokens = 0
            num = min(seq.num_uncomputed_tokens, budget)
            if num == 0:
                idle.append(seq)
                i += 1
                continue
            if not self.config.kv_cache and num < len(seq):
                i += 1  # without a cache a sequence is computed whole or not at all
                continue
            drafts = self._drafts_to_verify(seq, num, budget)
            copies = self.blocks.allocate_slots(seq, num + len(drafts.token_ids)) if drafts else None
            if copies is None:  # short of blocks for the drafts: a plain decode still may fit
                drafts, copies = None, self.blocks.allocate_slots(seq, num)
            while copies is None:
                # An idle beam first (it keeps its logits; only its cache is recomputed, later), else
                # the most recently arrived of those not yet scheduled this iteration.
                if idle:
                    victim = idle.pop()
                    i -= 1  # it stood before seq in self.running
                    self._preempt(victim, front=False)
                else:
                    victim = max(self.running[i:], key=lambda s: s.seq_id)
                    self._preempt(victim)
                if victim is seq:
                    break
                copies = self.blocks.allocate_slots(seq, num)
            if copies is None:
                continue  # seq itself was preempted; self.running[i] is now the next one
            out.block_copies += copies
            out.scheduled.append(self._entry(seq, num, drafts))
            budget -= out.scheduled[-1].num_tokens
            i += 1
        return budget

    def _drafts_to_verify(self, seq: Sequence, num: int, budget: int) -> Drafts | None:
        """The drafts held for a decoding sequence, cut to the token budget; they are used now or never."""
        drafts = self.drafts.pop(seq.seq_id, None)
        k = min(len(drafts.token_ids), budget - 1) if drafts and num == 1 else 0
        if k <= 0:
            return None
        return Drafts(drafts.token_ids[:k], None if drafts.q is None else drafts.q[:k])

    def _preempt(self, seq: Sequence, front: bool = True) -> None:
        num_blocks = len(seq.block_table)
        self.running.remove(seq)
        self.drafts.pop(seq.seq_id, None)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.num_preemptions += 1
        self.on_preempt(seq, num_blocks)

    # ---- admission ------------------------------------------------------------------------------

    def _may_admit(self) -> bool:
        if self.config.batching == "static":
            return not self.running  # a static batch waits for its longest member
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.blocks.lookup_prefix(seq) if self.config.kv_cache else []
            cached = len(hits) * self.config.block_size
            num = len(seq) - cached if self.config.kv_cache else len(seq)
            if num > budget:
                if not self.config.chunked_prefill or not self.config.kv_cache:
                    return  # FCFS: the head of the queue waits for a fresh budget
                num = budget
            # Look before taking anything, so that a request that must keep waiting leaves no trace.
            if not self.blocks.can_admit(seq, hits, self._slots_to_reserve(cached, num)):
                return
            seq.num_computed_tokens = seq.num_cached_prompt_tokens = self.blocks.match_prefix(seq, hits)
            copies = self.blocks.allocate_slots(seq, self._slots_to_reserve(cached, num))
            assert copies is not None, "can_admit promised these blocks"
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.block_copies += copies
            out.scheduled.append(self._entry(seq, num))
            budget -= num

    def _slots_to_reserve(self, num_computed: int, num: int) -> int:
        if self.config.kv_layout == "contiguous":
            # Before paging, a server reserved the longest possible sequence up front.
            return max(num, self.config.max_model_len - num_computed)
        return num

    # ---- update: every write of a sequence's state ------------------------------------------------

    def computed(self, seq: Sequence, num_tokens: int) -> None:
        """The first num_tokens of the sequence now have their K/V in the cache."""
        seq.num_computed_tokens = num_tokens
        self.blocks.commit_computed(seq)

    def append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)

    def truncate(self, seq: Sequence, num_slots: int) -> None:
        """Give back the slots (and emptied blocks) past num_slots: rejected or unused drafts roll back."""
        self.blocks.truncate(seq, num_slots)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_slots)

    def hold_drafts(self, seq: Sequence, drafts: Drafts) -> None:
        """Drafts proposed in this step's update, for the sequence's next decode to verify."""
        if drafts.token_ids:
            self.drafts[seq.seq_id] = drafts

    def _free(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0

    # ---- the draft model's own sequences (speculative.DraftModelProposer) ---------------------------

    def sync_draft(self, draft: Sequence, tokens: list[int]) -> None:
        """A draft model's sequence follows its target: keep the K/V of the common prefix, take its tokens."""
        common = next((i for i, (a, b) in enumerate(zip(draft.token_ids, tokens)) if a != b),
                      min(len(draft.token_ids), len(tokens)))
        new = not draft.block_table
        if not new:
            self.truncate(draft, min(common, draft.num_computed_tokens))
        draft.token_ids = list(tokens)
        if new:  # a new draft sequence reuses the draft model's cached prefix
            draft.num_computed_tokens = self.blocks.match_prefix(draft, count=False)

    def blocks_for_next_decodes(self) -> int:
        """Free blocks the running sequences need to decode their next token (a draft must leave them)."""
        return sum(self.blocks.blocks_needed(seq, 1) for seq in self.running)

    def reserve_draft(self, draft: Sequence, num_tokens: int, keep_free: int) -> list[tuple[int, int]] | None:
        """Slots for a draft model's forward, or None: drafts never take the `keep_free` blocks that the
        running sequences' next tokens need (a draft is worth less than a preemption), and shared
        blocks are copied before the draft model writes them, as the target's are."""
        if not self.blocks.can_allocate(self.blocks.blocks_needed(draft, num_tokens) + keep_free):
            return None
        return self.blocks.allocate_slots(draft, num_tokens)

    def release_draft(self, draft: Sequence) -> None:
        self._free(draft)
