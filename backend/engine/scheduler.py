"""The scheduler: which sequences run in each iteration, and the one place a step's results become state.

    schedule(now)                  -> SchedulerOutput   who runs, with how many tokens (ids and ints)
    step_input(plan)               -> StepInput         the executor's data: tokens, slots, sampling
    update_from_output(plan, out)  -> [EngineOutput]    tokens appended, drafts judged, ends, finishes
    schedule_drafts()              -> DraftInput        speculative decoding: what to draft, blocks reserved
    update_from_drafts(inp, out)   -> [EngineOutput]    the drafts held for the next step's verify

Continuous batching, first come first served: each iteration has a token budget and a cap on
running sequences. Running sequences go first (decodes, then the rest of chunked prefills), then
waiting ones are admitted while budget, slots and blocks last. When blocks run out, the most
recently arrived running sequence is preempted by recompute: its blocks are freed and it goes back
to the front of the queue. `static` batching admits a new batch only when the last one has fully
finished, as servers did before continuous batching.

The request table lives here (requests, their live sequences, grammar positions, output texts,
the draft model's sequences), and nothing else writes it: tests/test_one_writer.py fails when
another module assigns a request's or a sequence's state. Block tables are the block manager's,
keyed by seq_id. Every change is also recorded, in order, as an output (request_output.py): the
engine builds the events and the API's stream from those alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.admission import NewRequest
from kvscope.backend.engine.beam_search import BeamChoice, BeamState, Hypothesis, select
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.detokenizer import IncrementalText
from kvscope.backend.engine.grammar import Matcher
from kvscope.backend.engine.metrics import RequestTimes, SpecStats
from kvscope.backend.engine.request import Request, finish_reason, stream_generators
from kvscope.backend.engine.request_output import (Arrived, BlockChange, Drafted, EngineOutput, Finished, Forked,
                                                   Preempted, SeqEnded, Token, Verified)
from kvscope.backend.engine.sampler import penalised, uniform
from kvscope.backend.engine.scheduler_output import ScheduledRow, SchedulerOutput
from kvscope.backend.engine.sequence import Sequence, SeqStatus
from kvscope.backend.engine.step_input import DraftInput, DraftRow, RowSampling, RowTokens, StepInput, step_input
from kvscope.backend.engine.step_output import DraftOutput, RowOutput, StepOutput
from kvscope.backend.model.tokenizer import Tokenizer
from kvscope.backend.phase import phase_of

DRAFT_NAMESPACE = 1  # the draft model's sequences: their prefix-cache hashes are kept apart from the target's

# What an instance runs: both (one engine), or one side of disaggregated prefill and decode. A prefill
# instance leaves a prefilled sequence (its next step a decode) running but unscheduled until it moves;
# a decode instance is given prefilled requests only, and recomputes there what it preempts.
Role = Literal["both", "prefill", "decode"]


@dataclass
class Numbering:
    """Where sequence ids and arrival numbers come from: a scheduler's own, or one that a disaggregated
    engine's instances share, so that a sequence keeps its id as it moves and a request's default seed
    (its arrival number) is the one it would have had on one engine."""

    next_seq_id: int = 0
    next_arrival: int = 0


@dataclass
class Moving:
    """A prefilled request taken out of a prefill instance's scheduler, on its way to a decode instance's."""

    request: Request
    seqs: list[Sequence]  # its live sequences, in fork order
    tables: list[list[int]]  # each one's block table in the pool it leaves
    sent_at: float  # the prefill instance's clock as it left
    matchers: dict[int, Matcher] = field(default_factory=dict)
    texts: dict[int, IncrementalText] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, tokenizer: Tokenizer, seed: int = 0,
                 clock: Callable[[], float] = lambda: 0.0, role: Role = "both",
                 numbering: Numbering | None = None) -> None:
        self.config, self.tokenizer, self.seed, self.clock = config, tokenizer, seed, clock
        self.role, self.numbering = role, numbering or Numbering()
        self.eos_ids = list(tokenizer.eos_token_ids)
        self._outputs: list[EngineOutput] = []  # what changed since the last stage returned, in order
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching and config.kv_cache,
                                   lambda type, **fields: self._outputs.append(BlockChange(type, fields)))
        self.requests: dict[str, Request] = {}  # finished ones too, until forgotten
        self.live: dict[int, Sequence] = {}  # seq_id -> every sequence not yet ended, in creation order
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.matchers: dict[int, Matcher] = {}  # seq_id -> its grammar position (structured outputs)
        self.texts: dict[int, IncrementalText] = {}  # seq_id -> its output text (beams have none)
        self.drafts: dict[int, tuple[int, ...]] = {}  # seq_id -> drafts for its next step's verify
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> the draft model's sequence
        self.spec_stats = SpecStats()
        self.num_preemptions = 0

    # ---- the table --------------------------------------------------------------------------------

    def add_request(self, new: NewRequest, step_no: int) -> list[EngineOutput]:
        """Queue a request prepared by admission.prepare (already checked)."""
        params = new.params
        seq = Sequence(self._new_seq_id(), new.request_id, list(new.prompt_ids), len(new.prompt_ids))
        arrival = self.numbering.next_arrival
        self.numbering.next_arrival += 1
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + arrival
        draft_generator = torch.Generator().manual_seed((seed + 0x5EED) % 2**63) if self.config.speculative else None
        req = Request(new.request_id, new.prompt_ids, new.prompt_text, new.max_tokens, params, seed, step_no,
                      RequestTimes(new.arrival), seq, [seq], {seq.seq_id: 0}, {seq.seq_id: 0.0},
                      generators=stream_generators(seed, params),
                      beam=BeamState(params.beam_width, params.length_penalty) if params.beam_width else None,
                      draft_generator=draft_generator)
        self.requests[req.request_id] = req
        self.live[seq.seq_id] = seq
        if new.matcher is not None:
            self.matchers[seq.seq_id] = new.matcher
        if req.beam is None:
            self.texts[seq.seq_id] = IncrementalText(self.tokenizer, params.stop)
        self.waiting.append(seq)
        self._outputs.append(Arrived(req.request_id, seq.seq_id, len(new.prompt_ids), new.prompt_ids,
                                     new.prompt_text, params, new.max_tokens))
        return self._drain()

    def abort(self, request_id: str, why: str) -> list[EngineOutput]:
        """End the whole request (every live sequence) with finish_reason abort; nothing for a finished one."""
        req = self.requests.get(request_id)
        if req is not None and req.finish_reason is None:
            self._abort(req, why)
        return self._drain()

    def forget(self, request_id: str) -> None:
        """Drop a finished request (a server that lives forever must not keep them all); unknown ids are fine."""
        req = self.requests.get(request_id)
        if req is not None:
            assert req.finish_reason is not None, f"request {request_id!r} is not finished"
            del self.requests[request_id]

    def live_of(self, req: Request) -> list[Sequence]:
        return [s for s in req.seqs if s.seq_id in self.live]

    def live_sequences(self) -> list[Sequence]:
        """Every sequence holding blocks or waiting for them: the requests' and the draft model's."""
        return [*self.live.values(), *self.shadows.values()]

    def _new_seq_id(self) -> int:
        self.numbering.next_seq_id += 1
        return self.numbering.next_seq_id - 1

    # ---- disaggregated prefill: requests leave a prefill instance and arrive at a decode instance ---

    @staticmethod
    def _prefilled(seq: Sequence) -> bool:
        """Past its prompt with only its newest token to compute: its next step is a decode."""
        return bool(seq.output_token_ids) and seq.num_uncomputed_tokens == 1

    def prefilled_requests(self) -> list[str]:
        """The unfinished requests whose every live sequence runs prefilled: ready to move, in arrival order."""
        return [req.request_id for req in self.requests.values()
                if req.finish_reason is None and (live := self.live_of(req))
                and all(s.status == SeqStatus.RUNNING and self._prefilled(s) for s in live)]

    def moving(self, request_id: str) -> Moving:
        """A prefilled request as it would leave: its sequences and their blocks here (nothing changes yet)."""
        req = self.requests[request_id]
        seqs = self.live_of(req)
        return Moving(req, seqs, [self.blocks.block_table(s.seq_id) for s in seqs], self.clock(),
                      {s.seq_id: self.matchers[s.seq_id] for s in seqs if s.seq_id in self.matchers},
                      {s.seq_id: self.texts[s.seq_id] for s in seqs if s.seq_id in self.texts})

    def release(self, moving: Moving) -> list[EngineOutput]:
        """Let a request go once its blocks were copied elsewhere: it leaves the table and frees its blocks."""
        del self.requests[moving.request.request_id]
        for seq in moving.seqs:
            self.running.remove(seq)
            del self.live[seq.seq_id]
            self.matchers.pop(seq.seq_id, None)
            self.texts.pop(seq.seq_id, None)
            self.blocks.free(seq)
        return self._drain()

    def adopt(self, moving: Moving) -> tuple[dict[int, int] | None, list[EngineOutput]]:
        """Take in a prefilled request: blocks for its sequences (None, and nothing changed, if too few are
        free), and it runs from the next step. Returns its blocks there -> its blocks here, for the caller to
        copy the contents before that step; then `arrived` says what the copy took."""
        here = self.blocks.adopt(list(zip(moving.seqs, moving.tables, strict=True)))
        if here is None:
            return None, []
        req = moving.request
        self.requests[req.request_id] = req
        for seq in moving.seqs:
            self.live[seq.seq_id] = seq
            self.running.append(seq)
        self.matchers.update(moving.matchers)
        self.texts.update(moving.texts)
        return here, self._drain()

    def arrived(self, moving: Moving, transfer_s: float) -> None:
        """The request's blocks are here, after transfer_s on the link: its times move onto this instance's
        clock, which reads now what the prefill instance's read at sent_at plus the transfer, and its first
        token counts as given now."""
        t = moving.request.times
        shift = self.clock() - moving.sent_at - transfer_s
        t.arrival += shift
        t.scheduled = t.scheduled + shift if t.scheduled is not None else None
        t.first_token, t.transfer_s = self.clock(), transfer_s

    def _drain(self) -> list[EngineOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # ---- schedule -----------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """This iteration's batch; `now` is its start (a request's queueing ends at its first iteration)."""
        self._abort_impossible()
        rows: list[ScheduledRow] = []
        copies: list[tuple[int, int]] = []
        budget = self._schedule_running(rows, copies, self.config.max_num_batched_tokens)
        if self._may_admit():
            self._admit_waiting(rows, copies, budget)
        idle = [seq for seq in self.running if seq.num_uncomputed_tokens == 0]
        if not rows and self.waiting and idle:
            # Every running sequence is a beam waiting for a sibling that waits for blocks: make room.
            # The preempted beam keeps its next-token log-probs (only its cache is recomputed later),
            # so it queues behind the sibling that needs the blocks now.
            self._preempt(max(idle, key=lambda s: s.seq_id), front=False)
            self._admit_waiting(rows, copies, budget)
        self.drafts.clear()  # drafts are verified in the step after they were proposed, or never
        for row in rows:
            times = self.requests[row.request_id].times
            if times.scheduled is None:
                times.scheduled = now
        return SchedulerOutput(rows, copies, len(self.running), len(self.waiting), self.blocks.num_used_blocks,
                               self._drain())

    def _row(self, seq: Sequence, num: int, drafts: tuple[int, ...] = ()) -> ScheduledRow:
        k = len(drafts)
        context_len = seq.num_computed_tokens + num + k
        reaches_end = context_len == len(seq) + k
        phase = phase_of(num + k, k, reaches_end, bool(seq.output_token_ids), self.config.kv_cache)
        return ScheduledRow(seq.request_id, seq.seq_id, phase, num + k, context_len, reaches_end, drafts)

    def _schedule_running(self, rows: list[ScheduledRow], copies: list[tuple[int, int]], budget: int) -> int:
        i = 0
        idle: list[Sequence] = []  # beams whose logits are in, waiting for their siblings
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.role == "prefill" and self._prefilled(seq):
                i += 1  # its decodes are a decode instance's: it waits here, holding its blocks, to move
                continue
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
            got = self.blocks.allocate_slots(seq, num + len(drafts)) if drafts else None
            if got is None:  # short of blocks for the drafts: a plain decode still may fit
                drafts, got = (), self.blocks.allocate_slots(seq, num)
            while got is None:
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
                got = self.blocks.allocate_slots(seq, num)
            if got is None:
                continue  # seq itself was preempted; self.running[i] is now the next one
            copies += got
            rows.append(self._row(seq, num, drafts))
            budget -= rows[-1].num_tokens
            i += 1
        return budget

    def _drafts_to_verify(self, seq: Sequence, num: int, budget: int) -> tuple[int, ...]:
        """The drafts held for a decoding sequence, cut to the token budget."""
        drafts = self.drafts.get(seq.seq_id, ())
        k = min(len(drafts), budget - 1) if num == 1 else 0
        return drafts[:k] if k > 0 else ()

    def _preempt(self, seq: Sequence, front: bool = True) -> None:
        num_blocks = self.blocks.num_blocks_of(seq.seq_id)
        self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        self.num_preemptions += 1
        self._release_shadow(seq)  # the draft recomputes too, from the target's tokens
        self._outputs.append(Preempted(seq.request_id, seq.seq_id, num_blocks))

    def _may_admit(self) -> bool:
        if self.config.batching == "static":
            return not self.running  # a static batch waits for its longest member
        return True

    def _admit_waiting(self, rows: list[ScheduledRow], copies: list[tuple[int, int]], budget: int) -> None:
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
            got = self.blocks.allocate_slots(seq, self._slots_to_reserve(cached, num))
            assert got is not None, "can_admit promised these blocks"
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            copies += got
            rows.append(self._row(seq, num))
            budget -= num

    def _slots_to_reserve(self, num_computed: int, num: int) -> int:
        if self.config.kv_layout == "contiguous":
            # Before paging, a server reserved the longest possible sequence up front.
            return max(num, self.config.max_model_len - num_computed)
        return num

    def _abort_impossible(self) -> None:
        """A sequence that has outgrown the whole cache can never run again: end it, let the rest go on."""
        for seq in list(self.live.values()):
            need = math.ceil((len(seq) + 1) / self.config.block_size)
            req = self.requests[seq.request_id]
            if need > self.blocks.num_blocks and req.finish_reason is None:
                self._abort(req, f"needs {need} KV blocks, the cache has {self.blocks.num_blocks}")

    # ---- the executor's input -------------------------------------------------------------------------

    def step_input(self, plan: SchedulerOutput, dist_top_n: int = 0, keep_raw: bool = False) -> StepInput:
        """The plan as the executor's data, each sampling row with its random numbers and grammar masks.

        dist_top_n, keep_raw: what the observers want back (step_output.py)."""
        rows, sampling = [], []
        for row in plan.rows:
            seq = self.live[row.seq_id]
            begin = row.context_len - row.num_tokens
            tokens = seq.token_ids[begin:row.context_len - row.num_draft] + list(row.drafts)
            rows.append(RowTokens(row.request_id, row.seq_id, row.phase, tokens, begin,
                                  self.blocks.block_table(row.seq_id), row.num_draft, row.samples))
            sampling.append(self._row_sampling(row, seq))
        return step_input(rows, plan.block_copies, self.config.block_size, sampling, self.eos_ids, dist_top_n,
                          keep_raw)

    def _row_sampling(self, row: ScheduledRow, seq: Sequence) -> RowSampling | None:
        """How the row's logits become tokens, with the uniforms drawn now from its streams' generators."""
        req, matcher = self.requests[row.request_id], self.matchers.get(seq.seq_id)
        params = req.params
        history = list(seq.token_ids) if penalised(params) else None
        if row.drafts:
            streams = [req.streams[seq.seq_id]] * (row.num_draft + 1)
            return RowSampling("verify", params, self._uniforms(req, streams), history=history,
                               prompt_len=seq.num_prompt_tokens, drafts=list(row.drafts),
                               allowed=matcher.masks(list(row.drafts)) if matcher else None)
        if not row.samples:
            return None
        if req.beam is not None:
            return RowSampling("beam", params, beam_top=req.beam.width + len(self.eos_ids))
        # n > 1: the first token is drawn n times from the same logits, stream i for the sibling forked i-th.
        first_of_n = params.n > 1 and len(req.seqs) == 1 and not seq.output_token_ids
        streams = list(range(params.n)) if first_of_n else [req.streams[seq.seq_id]]
        return RowSampling("sample", params, self._uniforms(req, streams), streams=len(streams), history=history,
                           prompt_len=seq.num_prompt_tokens, allowed=matcher.masks([]) if matcher else None)

    @staticmethod
    def _uniforms(req: Request, streams: list[int]) -> list[float]:
        return [] if req.params.greedy else [uniform(req.generators[s]) for s in streams]

    # ---- update: a step's results become state -------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, out: StepOutput) -> list[EngineOutput]:
        """Record what the batch computed, append the tokens each row drew (forking n > 1 requests at their
        first token, advancing beams, judging drafts), end what ends and finish what finishes."""
        now = self.clock()
        sampled: list[tuple[Sequence, RowOutput]] = []
        beams: list[tuple[Sequence, RowOutput]] = []
        verified: list[tuple[ScheduledRow, Sequence, RowOutput]] = []
        failed: list[tuple[Sequence, str]] = []
        for row, result in zip(plan.rows, out.rows, strict=True):
            seq = self.live[row.seq_id]
            if result is not None and result.error:
                failed.append((seq, result.error))
            elif row.drafts:  # its cache is settled only once the drafts are judged
                verified.append((row, seq, result))
            else:
                self._computed(seq, row.context_len)
                if result is not None:
                    (beams if result.candidates else sampled).append((seq, result))
        for seq, error in failed:
            self._fail(seq, error)
        for seq, result in sampled:
            self._append_drawn(seq, result, now)
        self._advance_beams(beams, now)
        for row, seq, result in verified:
            self._apply_verdict(row, seq, result, now)
        return self._drain()

    def _append_drawn(self, seq: Sequence, result: RowOutput, now: float) -> None:
        """Each stream's token: one, or n at the first token of an n > 1 request (forking the siblings)."""
        req = self.requests[seq.request_id]
        seqs = [seq]
        if req.params.n > 1 and len(req.seqs) == 1 and not seq.output_token_ids:
            seqs += [self._fork(req, seq) for _ in range(req.params.n - 1)]
        assert len(seqs) == len(result.token_ids), "one drawn token per stream"
        for j, s in enumerate(seqs):
            self._append(req, s, result, j, now)

    def _append(self, req: Request, seq: Sequence, result: RowOutput, j: int, now: float,
                source: str = "target") -> bool:
        """Append the row's j-th token; end the sequence if it ends here. True if it did."""
        token = result.token_ids[j]
        text = self.texts.get(seq.seq_id)
        delta = text.push(token, stop_strings=token not in req.params.stop_token_ids) \
            if text is not None and token not in self.eos_ids else ""
        self._outputs.append(Token(
            req.request_id, seq.seq_id, token, result.logprobs[j],
            result.top_logprobs[j] if result.top_logprobs else None, delta, len(seq), source, req.params,
            result.tops[j] if result.tops else None, result.raw_probs[j] if result.raw_probs is not None else None,
            result.grammar[j] if result.grammar else None))
        self._extend(req, seq, token, result.logprobs[j], now)
        reason = finish_reason(req.params, token, len(seq.output_token_ids), len(seq), req.max_tokens,
                               self.config.max_model_len, self.eos_ids, text is not None and text.stopped)
        if reason is None and seq.seq_id in self.matchers and self.matchers[seq.seq_id].terminated:
            reason = "stop"  # the grammar ended (its EOS accepted under ignore_eos): nothing more may follow
        if reason:
            self._end_seq(req, seq, reason)
        return reason is not None

    def _extend(self, req: Request, seq: Sequence, token: int, logprob: float, now: float) -> None:
        """Append one token, with no stop check (beam search decides its ends itself)."""
        seq.token_ids.append(token)
        if seq.seq_id in self.matchers:
            self.matchers[seq.seq_id].accept(token)
        req.cumulative_logprob[seq.seq_id] += logprob
        req.times.num_output_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = now

    def _computed(self, seq: Sequence, num_tokens: int) -> None:
        """The first num_tokens of the sequence now have their K/V in the cache."""
        seq.num_computed_tokens = num_tokens
        self.blocks.commit_computed(seq)

    def _fork(self, req: Request, parent: Sequence) -> Sequence:
        """A new sequence of the request sharing every block of the parent (copy-on-write on divergence)."""
        child = Sequence(self._new_seq_id(), req.request_id, list(parent.token_ids), parent.num_prompt_tokens)
        self._outputs.append(Forked(req.request_id, child.seq_id, parent.seq_id, len(parent)))
        self.blocks.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = parent.status
        if parent.status == SeqStatus.RUNNING:
            self.running.append(child)
        else:  # a beam preempted while it waited for its siblings: the child recomputes too
            self.waiting.appendleft(child)
        req.seqs.append(child)
        req.streams[child.seq_id] = len(req.streams)
        req.cumulative_logprob[child.seq_id] = req.cumulative_logprob[parent.seq_id]
        self.live[child.seq_id] = child
        if parent.seq_id in self.matchers:
            self.matchers[child.seq_id] = self.matchers[parent.seq_id].fork()
        if req.beam is None:  # n > 1 forks before the first token: no text yet
            self.texts[child.seq_id] = IncrementalText(self.tokenizer, req.params.stop)
        return child

    # ---- ends ---------------------------------------------------------------------------------------

    def _end_seq(self, req: Request, seq: Sequence, reason: str) -> None:
        """One sequence ends: its blocks go back; the request ends with its last sequence."""
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        self._release_shadow(seq)
        del self.live[seq.seq_id]
        self.matchers.pop(seq.seq_id, None)
        req.seq_finish[seq.seq_id] = reason
        if reason == "pruned":
            req.seqs.remove(seq)  # a pruned beam returns nothing: keeps `live_of` short as beams fork every step
        elif req.beam is not None:
            req.beam.finished.append(Hypothesis(seq.seq_id, seq.output_token_ids, req.cumulative_logprob[seq.seq_id],
                                                reason))
        if req.multi:
            self._outputs.append(SeqEnded(req.request_id, seq.seq_id, reason))
        if not self.live_of(req):
            self._finish(req)

    def _abort(self, req: Request, why: str) -> None:
        req.abort_reason = why
        for seq in self.live_of(req):
            self._end_seq(req, seq, "abort")

    def _fail(self, seq: Sequence, error: str) -> None:
        """A row of this sequence could not be sampled: the sequence ends, aborted with the reason (a beam
        search, whose beams rank together, ends whole); the request reports the error when it finishes.
        Every other sequence and request goes on."""
        req = self.requests[seq.request_id]
        if req.finish_reason is not None:
            return
        req.error = req.error or f"{error} (at output token {len(seq.output_token_ids) + 1})"
        if req.abort_reason is None:
            req.abort_reason = req.error
        if req.beam is not None:
            self._abort(req, req.abort_reason)
        else:
            self._end_seq(req, seq, "abort")

    def _finish(self, req: Request) -> None:
        req.outputs = self._returned(req)
        best = req.outputs[0]
        # An aborted request says so, even if one of its beams had already found EOS.
        req.finish_reason = "abort" if req.abort_reason is not None else best["finish_reason"]
        req.output_text = best["output_text"]
        req.times.finish = self.clock()
        for seq in req.seqs:
            self.texts.pop(seq.seq_id, None)
        t = req.times
        moved = {"transfer_s": t.transfer_s} if t.transfer_s is not None else {}
        self._outputs.append(Finished(req.request_id, req.finish_reason, tuple(req.outputs),
                                      req.seq.num_cached_prompt_tokens, req.abort_reason, req.multi,
                                      {"ttft_s": t.ttft(), "tpot_s": t.tpot(), "e2e_s": t.e2e(), "queue_s": t.queue(),
                                       **moved}, req.error))

    def _returned(self, req: Request) -> list[dict]:
        """What the request returns: its sequences (n > 1, in order) or its best hypotheses (beam search)."""
        if req.beam is not None and req.beam.finished:
            return [{"seq_id": h.seq_id, "output_token_ids": h.output_token_ids, "finish_reason": h.finish_reason,
                     "output_text": self._decode(h.output_token_ids), "cumulative_logprob": h.cumulative_logprob,
                     "score": h.score(req.beam.length_penalty)}
                    for h in req.beam.ranked()[:req.params.n]]
        return [{"seq_id": s.seq_id, "output_token_ids": s.output_token_ids, "finish_reason": req.seq_finish[s.seq_id],
                 "output_text": self._output_text(s), "cumulative_logprob": req.cumulative_logprob[s.seq_id],
                 "score": None}
                for s in req.seqs]

    def _output_text(self, seq: Sequence) -> str:
        text = self.texts.get(seq.seq_id)
        return text.text() if text is not None and text.stopped else self._decode(seq.output_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos_ids])

    def _free(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0

    def _truncate(self, seq: Sequence, num_slots: int) -> None:
        """Give back the slots (and emptied blocks) past num_slots: rejected or unused drafts roll back."""
        self.blocks.truncate(seq, num_slots)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_slots)

    # ---- beam search ----------------------------------------------------------------------------------

    def _advance_beams(self, rows: list[tuple[Sequence, RowOutput]], now: float) -> None:
        """Store each beam's candidates; a request whose live beams all have them takes its step."""
        ready: list[Request] = []
        for seq, result in rows:
            req = self.requests[seq.request_id]
            if req.finish_reason is not None:  # a sibling's row failed, and the whole search with it
                continue
            req.beam.pending[seq.seq_id] = result.candidates
            if req not in ready and all(s.seq_id in req.beam.pending for s in self.live_of(req)):
                ready.append(req)
        for req in ready:
            self._beam_step(req, now)

    def _beam_step(self, req: Request, now: float) -> None:
        beam, live = req.beam, self.live_of(req)
        candidates = [beam.pending.pop(s.seq_id) for s in live]
        choices, finishing = select([req.cumulative_logprob[s.seq_id] for s in live], candidates, beam.width,
                                    self.eos_ids, not req.params.ignore_eos)
        for c in finishing:
            parent = live[c.parent]
            beam.finished.append(Hypothesis(parent.seq_id, parent.output_token_ids + [c.token_id],
                                            c.cumulative_logprob, "eos"))
        # Fork before anyone appends: a beam chosen twice hands its current tokens to the child.
        kept: list[tuple[Sequence, BeamChoice]] = []
        for c in choices:
            parent = live[c.parent]
            taken = any(c.parent == other.parent for _, other in kept)
            kept.append((self._fork(req, parent) if taken else parent, c))
        chosen = {c.parent for c in choices}
        for i, seq in enumerate(live):
            if i not in chosen:
                self._end_seq(req, seq, "pruned")
        for seq, c in kept:
            self._outputs.append(Token(req.request_id, seq.seq_id, c.token_id, c.logprob, None, "", len(seq),
                                       params=req.params))
            self._extend(req, seq, c.token_id, c.logprob, now)
        full = any(len(s.output_token_ids) >= req.max_tokens or len(s) >= self.config.max_model_len for s, _ in kept)
        # At the length limit every kept beam is a hypothesis (the best n are chosen among them all);
        # else with enough hypotheses the rest are dropped. Decided once, before any ends.
        reason = "length" if full else "pruned" if beam.done else None
        if reason is not None:
            for seq, _ in kept:
                self._end_seq(req, seq, reason)

    # ---- speculative decoding --------------------------------------------------------------------------

    def _apply_verdict(self, row: ScheduledRow, seq: Sequence, result: RowOutput, now: float) -> None:
        """A verify row's verdict: the accepted drafts and the token after them are appended, the rejected
        drafts' slots roll back in both caches."""
        req, start = self.requests[row.request_id], len(seq)
        judged = list(row.drafts[:len(result.draft_p)])  # the executor may judge fewer (sample_step._verify_row)
        self.spec_stats.record(len(judged), result.num_accepted, result.expected_accept)
        self._outputs.append(Verified(req.request_id, seq.seq_id, start, judged, result))
        sources = ["draft_accepted"] * result.num_accepted + [result.source]
        for j, source in enumerate(sources):
            if self._append(req, seq, result, j, now, source):
                return  # the sequence ended here: its blocks (and its draft's) are gone already
        self._computed(seq, start + result.num_accepted)  # the last token and the accepted drafts
        if self.config.kv_layout == "paged":  # give back the rejected drafts' slots (contiguous keeps them)
            self._truncate(seq, len(seq))
        shadow = self.shadows.get(seq.seq_id)
        if shadow is not None:  # the draft keeps its K/V of the target's computed tokens only
            self._truncate(shadow, min(shadow.num_computed_tokens, seq.num_computed_tokens))

    def schedule_drafts(self) -> DraftInput:
        """What to draft after this step's update: every running sequence whose next step is a decode, as
        many tokens as could still be kept. A draft model's forwards get their blocks here, round by round
        as it will run them: never the blocks the running sequences need for their next token (a draft is
        worth less than a preemption), shared blocks copied before the draft model writes them."""
        wanted = [(seq, k) for seq in self.running
                  if seq.num_uncomputed_tokens == 1 and seq.output_token_ids and (k := self._num_draft(seq))]
        if self.config.speculative.method == "ngram":
            return DraftInput([self._draft_row(seq, k) for seq, k in wanted], eos_ids=self.eos_ids)
        keep_free = sum(self.blocks.blocks_needed(seq, 1) for seq in self.running)
        copies: list[tuple[int, int]] = []
        reserved: list[list] = []  # [seq, k wanted, shadow, catch-up tokens, rounds reserved]
        for seq, k in wanted:
            shadow = self._sync_shadow(seq)
            num = len(shadow) - shadow.num_computed_tokens
            got = self._reserve_draft(shadow, num, keep_free)
            if got is not None:
                copies += got
                reserved.append([seq, k, shadow, num, 1])
        for round_ in range(1, max((k for _, k in wanted), default=0)):  # one more slot per further draft
            for entry in reserved:
                seq, k, shadow, num, rounds = entry
                if k > round_ and rounds == round_ and (got := self._reserve_draft(shadow, num + round_, keep_free)) \
                        is not None:
                    copies += got
                    entry[4] += 1
        rows = [self._draft_row(seq, rounds, shadow) for seq, _, shadow, _, rounds in reserved]
        return DraftInput(rows, copies, self.eos_ids)

    def update_from_drafts(self, inp: DraftInput, out: DraftOutput) -> list[EngineOutput]:
        """Hold each row's drafts for its next step's verify; a draft model's sequence now holds them too (all
        but the last computed)."""
        method = self.config.speculative.method
        for row, drafted, q_probs in zip(inp.rows, out.token_ids, out.q_probs, strict=True):
            seq = self.live[row.seq_id]
            shadow = self.shadows.get(row.seq_id)
            if shadow is not None and drafted:
                shadow.token_ids = list(seq.token_ids) + drafted
                self._computed(shadow, len(shadow) - 1)
            self._outputs.append(Drafted(seq.request_id, seq.seq_id, len(seq), drafted, q_probs, method,
                                         row.draft_seq_id))
            if drafted:
                self.drafts[seq.seq_id] = tuple(drafted)
        return self._drain()

    def _num_draft(self, seq: Sequence) -> int:
        """Drafts worth verifying: never past max_tokens or max_model_len (the +1 is the target's own token)."""
        req = self.requests[seq.request_id]
        left = min(req.max_tokens - len(seq.output_token_ids), self.config.max_model_len - len(seq)) - 1
        return max(0, min(self.config.speculative.num_tokens, left))

    def _draft_row(self, seq: Sequence, k: int, shadow: Sequence | None = None) -> DraftRow:
        req = self.requests[seq.request_id]
        uniforms = [] if req.params.greedy or shadow is None else [uniform(req.draft_generator) for _ in range(k)]
        if shadow is None:
            return DraftRow(seq.request_id, seq.seq_id, k, req.params, uniforms, list(seq.token_ids),
                            seq.num_prompt_tokens)
        return DraftRow(seq.request_id, seq.seq_id, k, req.params, uniforms, list(seq.token_ids),
                        seq.num_prompt_tokens, shadow.seq_id, shadow.num_computed_tokens,
                        self.blocks.block_table(shadow.seq_id))

    def _sync_shadow(self, seq: Sequence) -> Sequence:
        """The draft model's sequence for `seq`, following it: the K/V of their common prefix kept, its tokens taken."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(self._new_seq_id(), seq.request_id, [], seq.num_prompt_tokens,
                              cache_namespace=DRAFT_NAMESPACE)
            self.shadows[seq.seq_id] = shadow
        tokens = seq.token_ids
        common = next((i for i, (a, b) in enumerate(zip(shadow.token_ids, tokens)) if a != b),
                      min(len(shadow.token_ids), len(tokens)))
        new = not self.blocks.num_blocks_of(shadow.seq_id)
        if not new:
            self._truncate(shadow, min(common, shadow.num_computed_tokens))
        shadow.token_ids = list(tokens)
        if new:  # a new draft sequence reuses the draft model's cached prefix
            shadow.num_computed_tokens = self.blocks.match_prefix(shadow, count=False)
        return shadow

    def _reserve_draft(self, shadow: Sequence, num_tokens: int, keep_free: int) -> list[tuple[int, int]] | None:
        """Slots for num_tokens past the draft's computed ones, or None if they would take the `keep_free` blocks."""
        if not self.blocks.can_allocate(self.blocks.blocks_needed(shadow, num_tokens) + keep_free):
            return None
        return self.blocks.allocate_slots(shadow, num_tokens)

    def _release_shadow(self, seq: Sequence) -> None:
        """The target sequence ended or was preempted: its draft gives back every block (it recomputes later)."""
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self._free(shadow)
