"""Every request and its sequences: admission, forks (n > 1, beams), appended tokens, ends, finishes.

A request has one sequence, or several when it forks (`sampling.n`, beam search); they share
blocks through `BlockManager.fork`. A sequence ends on its own (`seq_end`); the request finishes
with its last sequence and returns its outputs (siblings in fork order, or the best hypotheses).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch
from pydantic import ValidationError

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.beam_search import BeamState, Hypothesis
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.grammar import Grammars, Matcher
from kvscope.backend.engine.metrics import RequestTimes
from kvscope.backend.engine.request_output import Arrived, Finished, Forked, Sink, Token, ignore
from kvscope.backend.engine.request import (Request, RequestError, check_fits, check_prompt_ids, check_supported,
                                    check_token_ids, finish_reason_after)
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.scheduler import ScheduledSeq, Scheduler
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.step_events import StepEvents
from kvscope.backend.errors import validation_error
from kvscope.backend.model.tokenizer import Tokenizer


class RequestTracker:
    def __init__(self, config: EngineConfig, blocks: BlockManager, scheduler: Scheduler, events: StepEvents,
                 tokenizer: Tokenizer, vocab_size: int, on_seq_end: Callable[[Sequence], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config, self.blocks, self.scheduler, self.events = config, blocks, scheduler, events
        self.clock = clock  # the engine's: wall time, or simulate mode's modelled seconds
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, events.eos_ids, vocab_size
        self.on_seq_end = on_seq_end  # the speculative decoder lets go of the sequence's draft
        self.on_output: Sink = ignore  # the caller's answers (Engine.stream_outputs)
        self.requests: dict[str, Request] = {}
        self.unfinished: dict[int, Request] = {}  # seq_id -> request
        self.grammars = Grammars(tokenizer, vocab_size, self.eos_ids)
        self.matchers: dict[int, Matcher] = {}  # seq_id -> its grammar position (structured outputs)
        self._next_seq_id = 0

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def request_of(self, seq: Sequence) -> Request:
        return self.unfinished[seq.seq_id]

    def live(self, req: Request) -> list[Sequence]:
        return [s for s in req.seqs if s.seq_id in self.unfinished]

    def live_sequences(self) -> list[Sequence]:
        """Every unfinished sequence of every request (holding blocks or waiting for them)."""
        requests = {id(r): r for r in self.unfinished.values()}.values()
        return [s for r in requests for s in r.seqs if s.seq_id in self.unfinished]

    def mark_scheduled(self, batch: Iterable[ScheduledSeq], started: float) -> None:
        """The iteration that started at `started` runs these: a request's queueing ends at its first."""
        for item in batch:
            req = self.unfinished.get(item.seq.seq_id)
            if req is not None and req.times.scheduled is None:
                req.times.scheduled = started

    def forget(self, request_id: str) -> None:
        """Drop a finished request (a server that lives forever must not keep them all); unknown ids are fine."""
        req = self.requests.get(request_id)
        if req is None:
            return
        assert req.finish_reason is not None, f"request {request_id!r} is not finished"
        del self.requests[request_id]

    # ---- admission --------------------------------------------------------------------------------

    def admit(self, request_id: str, prompt: str | list[int], max_tokens: int,
              sampling: SamplingParams | dict | None, num_blocks: int, seed: int, step_no: int,
              arrival: float | None = None) -> Request:
        """Queue a request, or raise RequestError naming the field it cannot accept. arrival: when it was
        received, on the engine's clock (a server's request waits for the step under way); default now."""
        if request_id in self.requests:
            raise RequestError("id", f"duplicate request id {request_id!r}")
        params = parse_sampling(sampling)
        check_supported(params, self.config)
        check_token_ids(params, self.vocab_size)
        matcher = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt_ids(ids, self.vocab_size)
        check_fits(self.config, num_blocks, len(ids), max_tokens)
        seq = Sequence(self.new_seq_id(), request_id, list(ids), len(ids))
        seed = params.seed if params.seed is not None else seed * 1_000_003 + seq.seq_id
        times = RequestTimes(self.clock() if arrival is None else arrival)
        req = Request(request_id, ids, prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                      max_tokens, params, seed, step_no, times, seq,
                      beam=BeamState(params.beam_width, params.length_penalty) if params.beam_width else None,
                      draft_generator=torch.Generator().manual_seed((seed + 0x5EED) % 2**63))
        self.requests[request_id] = req
        self.unfinished[seq.seq_id] = req
        if matcher is not None:
            self.matchers[seq.seq_id] = matcher
        self.scheduler.add(seq)
        self.events.request_arrived(req)
        self.on_output(Arrived(request_id, seq.seq_id, len(ids)))
        return req

    # ---- forks ------------------------------------------------------------------------------------

    def fork_for_n(self, seq: Sequence) -> list[Sequence]:
        """n > 1: right after the prompt, fork n - 1 siblings that draw their first token from the same logits."""
        req = self.unfinished[seq.seq_id]
        if req.params.n == 1 or len(req.seqs) > 1 or seq.output_token_ids:
            return [seq]
        return [seq] + [self.fork(req, seq) for _ in range(req.params.n - 1)]

    def fork(self, req: Request, parent: Sequence) -> Sequence:
        """A new sequence of the request sharing every block of the parent (copy-on-write on divergence)."""
        child = Sequence(self.new_seq_id(), req.request_id, list(parent.token_ids), parent.num_prompt_tokens)
        self.events.seq_fork(parent, child)
        self.scheduler.add_forked(child, parent)
        req.seqs.append(child)
        req.add_stream(child)
        req.cumulative_logprob[child.seq_id] = req.cumulative_logprob[parent.seq_id]
        self.unfinished[child.seq_id] = req
        if parent.seq_id in self.matchers:
            self.matchers[child.seq_id] = self.matchers[parent.seq_id].fork()
        self.on_output(Forked(req.request_id, child.seq_id))
        return child

    # ---- tokens -----------------------------------------------------------------------------------

    def extend(self, req: Request, seq: Sequence, token: int, logprob: float, now: float,
               alternatives: tuple[tuple[int, float], ...] | None = None) -> None:
        """Append one token, with no stop check (beam search decides its ends itself).

        alternatives: its top_logprobs, when the request asks for them."""
        self.scheduler.append(seq, token)
        if seq.seq_id in self.matchers:
            self.matchers[seq.seq_id].accept(token)
        self.on_output(Token(req.request_id, seq.seq_id, token, logprob, alternatives))
        req.cumulative_logprob[seq.seq_id] += logprob
        req.times.num_output_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = now

    def append(self, req: Request, seq: Sequence, token: int, logprob: float, now: float,
               alternatives: tuple[tuple[int, float], ...] | None = None) -> bool:
        """Append one generated token; end the sequence if it ends here. True if it did."""
        self.extend(req, seq, token, logprob, now, alternatives)
        reason = finish_reason_after(req, seq, token, self.eos_ids, self.config.max_model_len, self.tokenizer)
        if reason is None and seq.seq_id in self.matchers and self.matchers[seq.seq_id].terminated:
            reason = "stop"  # the grammar ended (its EOS accepted under ignore_eos): nothing more may follow
        if reason:
            self.end_seq(req, seq, reason)
        return reason is not None

    # ---- ends -------------------------------------------------------------------------------------

    def end_seq(self, req: Request, seq: Sequence, reason: str) -> None:
        """One sequence ends: its blocks go back; the request ends with its last sequence."""
        self.scheduler.remove(seq)
        self.on_seq_end(seq)
        self.unfinished.pop(seq.seq_id, None)
        self.matchers.pop(seq.seq_id, None)
        req.seq_finish[seq.seq_id] = reason
        if reason == "pruned":
            req.seqs.remove(seq)  # a pruned beam returns nothing: keeps `live` short as beams fork every step
        elif req.beam is not None:
            req.beam.finished.append(Hypothesis(seq.seq_id, seq.output_token_ids, req.cumulative_logprob[seq.seq_id],
                                                reason))
        if req.multi:
            self.events.seq_end(seq, reason)
        if not self.live(req):
            self._finish(req)

    def abort(self, req: Request, why: str) -> None:
        """End the whole request: every live sequence with it."""
        req.abort_reason = why
        for seq in self.live(req):
            self.end_seq(req, seq, "abort")

    def abort_impossible(self, num_blocks: int) -> None:
        """A sequence that has outgrown the whole cache can never run again: end it, let the rest go on."""
        for seq in self.live_sequences():
            need = math.ceil((len(seq) + 1) / self.config.block_size)
            req = self.requests[seq.request_id]
            if need > num_blocks and req.finish_reason is None:
                self.abort(req, f"needs {need} KV blocks, the cache has {num_blocks}")

    def _finish(self, req: Request) -> None:
        req.outputs = self._outputs(req)
        best = req.outputs[0]
        # An aborted request says so, even if one of its beams had already found EOS.
        req.finish_reason = "abort" if req.abort_reason is not None else best["finish_reason"]
        req.output_text = best["output_text"]
        req.times.finish = self.clock()
        self.events.request_finished(req)
        self.on_output(Finished(req.request_id, req.finish_reason, tuple(req.outputs),
                                req.seq.num_cached_prompt_tokens))

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


def parse_sampling(sampling: SamplingParams | dict | None) -> SamplingParams:
    """A request's sampling settings, validated (RequestError naming the first bad field)."""
    if isinstance(sampling, SamplingParams):
        return sampling
    try:
        return SamplingParams.model_validate(sampling or {})
    except ValidationError as e:
        raise validation_error(e, "sampling", RequestError) from None
