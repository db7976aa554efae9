"""The engine: one `step()` is one iteration of schedule -> run the model -> sample -> emit.

It knows nothing of HTTP or dashboards: everything it decides goes out as events on its bus.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
import uuid

import torch
from pydantic import ValidationError

from backend.config import EngineConfig
from backend.engine.beam_search import BeamState, Choice, Hypothesis, select
from backend.engine.block_manager import BlockManager
from backend.engine.kv_cache import DTYPE_NAMES, KVCache, check_kv_dtype, kv_formula, num_blocks_for_budget
from backend.engine.metrics import MetricsTracker, RequestTimes
from backend.engine.request import Request, RequestError, check_fits, check_supported, finish_reason_after
from backend.engine.runner import ModelRunner
from backend.engine.sampler import distributions, sample
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledSeq, Scheduler
from backend.engine.speculative import (DraftModelProposer, NgramProposer, Proposal, SpecRequest, SpecStats, Verdict,
                                        verify)
from backend.engine.sequence import Sequence, SeqStatus
from backend.events.bus import EventBus
from backend.events.schema import SCHEMA_VERSION
from backend.model.loader import LoadedModel, ModelLoadError, load_model
from backend.model.quant import QuantError, quantize_loaded


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def pick_attention_backend(config: EngineConfig, device: torch.device) -> str:
    """auto: the Triton kernels on CUDA, plain torch elsewhere. triton on a CPU needs the interpreter."""
    have_triton = importlib.util.find_spec("triton") is not None
    if config.attention_backend == "auto":
        return "triton" if device.type == "cuda" and have_triton else "torch"
    if config.attention_backend == "triton":
        if not have_triton:
            raise RequestError("engine.attention_backend", "triton is not installed; use torch (or auto)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RequestError("engine.attention_backend",
                               "the Triton kernels need a CUDA device; on a CPU set TRITON_INTERPRET=1 to run them "
                               "in Triton's (slow) interpreter, or use torch")
    return config.attention_backend


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, bus: EventBus | None = None, seed: int = 0,
                 draft: LoadedModel | None = None) -> None:
        if config.speculative is not None and not config.kv_cache:
            raise RequestError("engine.speculative", "speculative decoding verifies against the KV cache: "
                                                     "it needs kv_cache: true")
        try:  # weight_quant: run a quantized copy; the caller's LoadedModel (the server shares it) is untouched
            loaded, self.weights = quantize_loaded(loaded, config.weight_quant, config.quant_group_size)
        except QuantError as e:
            raise RequestError(e.field, e.reason) from None
        self.loaded, self.config, self.seed = loaded, config, seed
        self.tokenizer = loaded.tokenizer
        self.eos_ids = loaded.tokenizer.eos_token_ids
        self.bus = bus or EventBus(level=config.events)
        self.bus.level = config.events
        dtype = next(loaded.model.parameters()).dtype
        self.device = pick_device(config)
        self.attention_backend = pick_attention_backend(config, self.device)
        check_kv_dtype(config.kv_cache_dtype, loaded.config, self.attention_backend)
        kv_dtype = "int8" if config.kv_cache_dtype == "int8" else DTYPE_NAMES[dtype]
        num_blocks = config.num_blocks or num_blocks_for_budget(
            loaded.config, config.block_size, config.kv_cache_memory_mb, kv_dtype)
        self.cache = KVCache(loaded.config, num_blocks, config.block_size, dtype, self.device, config.kv_cache_dtype)
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching and config.kv_cache,
                                   self.bus.emit)
        self.runner = ModelRunner(loaded.model.to(self.device), self.cache, self.attention_backend)
        self.proposer = self._make_proposer(draft) if config.speculative else None
        self.spec_stats = SpecStats()
        self.scheduler = Scheduler(config, self.blocks, self._on_preempt,
                                   self._num_draft if self.proposer else None)
        self.metrics = MetricsTracker()
        self.requests: dict[str, Request] = {}
        self.unfinished: dict[int, Request] = {}  # seq_id -> request
        self.step_no = 0
        self._next_seq_id = 0
        self._token_text: dict[int, str] = {}

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

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _num_draft(self, seq: Sequence) -> int:
        """Drafts worth verifying: never past max_tokens or max_model_len (the +1 is the target's own token)."""
        req = self.unfinished[seq.seq_id]
        left = min(req.max_tokens - len(seq.output_token_ids), self.config.max_model_len - len(seq)) - 1
        return max(0, min(self.config.speculative.num_tokens, left))

    def live_sequences(self) -> list[Sequence]:
        """Every sequence holding blocks or waiting for them: the requests' and the draft model's."""
        requests = {id(r): r for r in self.unfinished.values()}.values()
        seqs = [s for r in requests for s in r.seqs if s.seq_id in self.unfinished]
        return seqs + (self.proposer.sequences() if self.proposer else [])

    # ---- the header: what a trace needs to make sense of everything after it ----------------------

    def emit_header(self, scenario: dict | None = None, model_name: str | None = None) -> None:
        c = self.loaded.config
        dtype, kv_dtype = DTYPE_NAMES[self.cache.dtype], DTYPE_NAMES[self.cache.storage_dtype]
        self.bus.emit(
            "header", schema_version=SCHEMA_VERSION, run_id=uuid.uuid4().hex[:12], scenario=scenario,
            config=self.config.model_dump(), attention_backend=self.attention_backend, device=str(self.device),
            model={"name": model_name or self.loaded.name, "n_layers": c.num_hidden_layers,
                   "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                   "attention": c.attention, "vocab_size": c.vocab_size, "dtype": dtype,
                   "kv_bytes_per_token": self.cache.bytes_per_token, "eos_token_ids": self.eos_ids},
            cache={"num_blocks": self.cache.num_blocks, "block_size": self.cache.block_size, "dtype": kv_dtype,
                   "bytes_per_block": self.cache.bytes_per_block, "formula": kv_formula(c, kv_dtype)},
            weights=self.weights,
            **self._draft_header(),
        )

    def _draft_header(self) -> dict:
        """The draft model's size and cache, when one runs beside the target."""
        if not isinstance(self.proposer, DraftModelProposer):
            return {}
        c, cache = self.draft.config, self.proposer.cache
        return {"draft_model": {"name": self.config.speculative.draft_model, "n_layers": c.num_hidden_layers,
                                "kv_bytes_per_token": cache.bytes_per_token,
                                "bytes_per_block": cache.bytes_per_block}}

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], max_tokens: int,
                    sampling: SamplingParams | dict | None = None) -> Request:
        """Queue a request, or refuse it (RequestError naming the field; a request_rejected event)."""
        try:
            return self._admit(request_id, prompt, max_tokens, sampling)
        except RequestError as e:
            self.bus.emit("request_rejected", request_id=request_id, field=e.field, reason=e.reason)
            raise

    def _admit(self, request_id: str, prompt: str | list[int], max_tokens: int,
               sampling: SamplingParams | dict | None) -> Request:
        if request_id in self.requests:
            raise RequestError("id", f"duplicate request id {request_id!r}")
        params = self._parse_sampling(sampling)
        check_supported(params, self.config)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < self.loaded.config.vocab_size for t in ids):
            raise RequestError("prompt", f"token ids must lie in [0, {self.loaded.config.vocab_size})")
        check_fits(self.config, self.cache.num_blocks, len(ids), max_tokens)
        seq = Sequence(self._new_seq_id(), request_id, list(ids), len(ids))
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + seq.seq_id
        req = Request(request_id, ids, prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                      max_tokens, params, seed, self.step_no, RequestTimes(time.perf_counter()), seq,
                      beam=BeamState(params.beam_width, params.length_penalty) if params.beam_width else None,
                      draft_generator=torch.Generator().manual_seed((seed + 0x5EED) % 2**63))
        self.requests[request_id] = req
        self.unfinished[seq.seq_id] = req
        self.scheduler.add(seq)
        self.bus.emit("request_arrived", request_id=request_id, seq_id=seq.seq_id, prompt_token_ids=ids,
                      prompt_text=req.prompt_text, sampling=params.model_dump(), max_tokens=max_tokens)
        return req

    @staticmethod
    def _parse_sampling(sampling: SamplingParams | dict | None) -> SamplingParams:
        if isinstance(sampling, SamplingParams):
            return sampling
        try:
            return SamplingParams.model_validate(sampling or {})
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise RequestError(f"sampling.{loc}" if loc else "sampling", err["msg"]) from None

    def abort(self, request_id: str, reason: str = "aborted by the user") -> None:
        req = self.requests.get(request_id)
        if req is not None and req.finish_reason is None:
            self._finish(req, "abort", reason)

    def has_unfinished(self) -> bool:
        return bool(self.unfinished)

    # ---- one iteration ------------------------------------------------------------------------------

    def step(self) -> None:
        """Schedule, run the model, sample, emit: one engine iteration."""
        self.bus.step = self.step_no
        started = time.perf_counter()
        self._abort_impossible()
        out = self.scheduler.schedule()
        verifying = [item for item in out.scheduled if item.phase == "verify"]
        proposals = self._propose(verifying) if verifying else []
        logits = self.runner.execute(out.scheduled, out.block_copies) if out.scheduled else None
        sampling: list[tuple[Sequence, int]] = []  # (sequence, its row of logits)
        beams: list[tuple[Sequence, int]] = []
        verify_rows, row = [], 0
        for item in out.scheduled:
            if item.phase == "verify":  # its cache is settled only once the drafts are judged
                verify_rows.append(logits[row:row + item.num_tokens])
                row += item.num_tokens
                continue
            item.seq.num_computed_tokens = item.context_len
            self.blocks.commit_computed(item.seq)
            if item.samples:
                (beams if self.unfinished[item.seq.seq_id].beam else sampling).append((item.seq, row))
                row += 1
        now = time.perf_counter()
        self._emit_iteration(out.scheduled, out.num_batched_tokens, now - started)
        sampling = [pair for seq, r in sampling for pair in self._fork_for_n(seq, r)]
        generated = len(sampling) + len(beams)
        if sampling:
            self._sample_and_append(sampling, logits, now)
        if beams:
            self._beam_search_step(beams, logits, now)
        for item, proposal, rows in zip(verifying, proposals, verify_rows, strict=True):
            generated += self._verify_and_append(item, proposal, rows, now)
        prefill = sum(i.num_tokens for i in out.scheduled if i.phase == "prefill")
        self.metrics.on_iteration(now, prefill, generated)
        self._emit_metrics()
        self.step_no += 1

    def _sample_and_append(self, pairs: list[tuple[Sequence, int]], logits: torch.Tensor, now: float) -> None:
        """Draw one token for each (sequence, row of logits), each from the sequence's own generator."""
        seqs = [seq for seq, _ in pairs]
        reqs = [self.unfinished[seq.seq_id] for seq in seqs]
        result = sample(logits[[r for _, r in pairs]], [r.params for r in reqs],
                        [r.generators[seq.seq_id] for r, seq in zip(reqs, seqs, strict=True)], self.eos_ids,
                        [seq.token_ids for seq in seqs], [seq.output_token_ids for seq in seqs])
        tops = self._top_tokens(result.raw_probs, result.final_probs, result.token_ids) if self.bus.wants_dist else None
        for row, (req, seq) in enumerate(zip(reqs, seqs, strict=True)):
            token = result.token_ids[row]
            self._emit_token(req, seq, token, result.logprobs[row], result.raw_probs[row], tops[row] if tops else None)
            self._append(req, seq, token, result.logprobs[row], now)

    def _extend(self, req: Request, seq: Sequence, token: int, logprob: float, now: float) -> None:
        seq.token_ids.append(token)
        req.cumulative_logprob[seq.seq_id] += logprob
        req.times.num_output_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = now

    def _append(self, req: Request, seq: Sequence, token: int, logprob: float, now: float) -> bool:
        """Append one generated token; end the sequence if it ends here. True if it did."""
        self._extend(req, seq, token, logprob, now)
        reason = finish_reason_after(req, seq, token, self.eos_ids, self.config.max_model_len, self.tokenizer)
        if reason:
            self._end_seq(req, seq, reason)
        return reason is not None

    # ---- several sequences per request: n > 1 and beam search ---------------------------------------

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
        if beam.done or full or not kept:
            for seq, _ in kept:  # enough hypotheses: the rest are dropped; at the length limit they count
                self._end_seq(req, seq, "pruned" if beam.done else "length")

    # ---- speculative decoding -----------------------------------------------------------------------

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
            if drafts:
                self.bus.emit("spec_propose", request_id=seq.request_id, seq_id=seq.seq_id, token_ids=drafts,
                              q_probs=[proposal.q[j, t].item() for j, t in enumerate(drafts)],
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
        prefixes = [seq.token_ids[:start + j] for j in range(k + 1)]  # what each row's penalties see
        raw_log, _, p = distributions(logits, [req.params] * (k + 1), self.eos_ids, prefixes,
                                      [t[seq.num_prompt_tokens:] for t in prefixes])
        verdict = verify(p, proposal.q, drafts, req.generators[seq.seq_id], req.params.greedy)
        del seq.token_ids[start:]
        seq.num_computed_tokens = start + verdict.num_accepted  # the last token and the accepted drafts
        expected = torch.minimum(p[:k], proposal.q).sum(-1).tolist() if k else []
        self.spec_stats.record(k, verdict.num_accepted, expected)
        self._emit_verify(seq, drafts, verdict, p, proposal.q, expected)
        new = drafts[:verdict.num_accepted] + [verdict.token_id]
        sources = ["draft_accepted"] * verdict.num_accepted + [verdict.source]
        raw = raw_log.exp()
        tops = self._top_tokens(raw[:len(new)], p[:len(new)], new) if self.bus.wants_dist else None
        for j, (token, source) in enumerate(zip(new, sources, strict=True)):
            logprob = raw_log[j, token].item()
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
        results = [{"token_id": t, "text": self.token_text(t), "p": p[j, t].item(), "q": q[j, t].item(),
                    "accepted": verdict.accepted[j]} for j, t in enumerate(drafts)]
        fields = {}
        if self.bus.wants_dist:
            q_full = torch.cat((q, torch.zeros_like(p[:1])))  # the bonus position has no draft
            n = self.config.dist_top_n
            fields["dists"] = [[[t, self.token_text(t), p[j, t].item(), q_full[j, t].item()]
                                for t in dict.fromkeys(p[j].topk(n).indices.tolist() + q_full[j].topk(n).indices.tolist())
                                if p[j, t] > 0 or q_full[j, t] > 0] for j in range(len(drafts) + 1)]
        resampled = verdict.source == "resampled"
        self.bus.emit("spec_verify", request_id=seq.request_id, seq_id=seq.seq_id, position=len(seq),
                      results=results, num_accepted=verdict.num_accepted,
                      resampled_token_id=verdict.token_id if resampled else None,
                      bonus_token_id=None if resampled else verdict.token_id, expected_accept=expected, **fields)

    def _end_seq(self, req: Request, seq: Sequence, reason: str) -> None:
        """One sequence ends: its blocks go back; the request ends with its last sequence."""
        seq.status = SeqStatus.FINISHED
        self.scheduler.remove(seq)
        if self.proposer:
            self.proposer.release(seq)
        self.unfinished.pop(seq.seq_id, None)
        req.seq_finish[seq.seq_id] = reason
        if req.beam is not None and reason != "pruned":
            req.beam.finished.append(Hypothesis(seq.seq_id, seq.output_token_ids, req.cumulative_logprob[seq.seq_id],
                                                reason))
        if req.multi:
            self.bus.emit("seq_end", request_id=req.request_id, seq_id=seq.seq_id, reason=reason)
        if not self._live(req):
            self._finish_request(req)

    def _finish(self, req: Request, reason: str, why: str | None = None) -> None:
        """End the whole request (an abort): every live sequence with it."""
        req.abort_reason = why
        for seq in self._live(req):
            self._end_seq(req, seq, reason)

    def _finish_request(self, req: Request) -> None:
        outputs = self._outputs(req)
        best = outputs[0]
        req.finish_reason, req.output_text = best["finish_reason"], best["output_text"]
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
                for s in req.seqs if req.seq_finish.get(s.seq_id) != "pruned"]

    def _abort_impossible(self) -> None:
        """A sequence that has outgrown the whole cache can never run again: end it, let the rest go on."""
        for seq_id, req in list(self.unfinished.items()):
            seq = next(s for s in req.seqs if s.seq_id == seq_id)
            need = math.ceil((len(seq) + 1) / self.config.block_size)
            if need > self.cache.num_blocks and req.finish_reason is None:
                self._finish(req, "abort", f"needs {need} KV blocks, the cache has {self.cache.num_blocks}")

    def _on_preempt(self, seq: Sequence, num_blocks: int) -> None:
        if self.proposer:
            self.proposer.release(seq)  # the draft recomputes too, from the target's tokens
        self.bus.emit("preempt", request_id=seq.request_id, seq_id=seq.seq_id, num_blocks_freed=num_blocks,
                      mode="recompute")

    # ---- events -------------------------------------------------------------------------------------

    def _emit_iteration(self, batch: list[ScheduledSeq], num_tokens: int, duration: float) -> None:
        self.bus.emit(
            "iteration",
            batch=[{"request_id": i.seq.request_id, "seq_id": i.seq.seq_id, "phase": i.phase,
                    "num_query_tokens": i.num_tokens, "context_len": i.context_len,
                    **({"num_draft_tokens": i.num_draft} if i.phase == "verify" else {})} for i in batch],
            num_batched_tokens=num_tokens, token_budget=self.config.max_num_batched_tokens,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks, duration_s=duration, max_num_seqs=self.config.max_num_seqs,
        )
        if self.bus.wants("attention_mask"):
            for i in batch:
                begin = i.context_len - i.num_tokens
                kind = i.phase if i.phase != "prefill" else ("chunked_prefill" if begin > 0 else "prefill")
                self.bus.emit("attention_mask", request_id=i.seq.request_id, seq_id=i.seq.seq_id, kind=kind,
                              query_positions=[begin, i.context_len], key_len=i.context_len)

    def _emit_token(self, req: Request, seq: Sequence, token: int, logprob: float, raw_probs: torch.Tensor | None,
                    top: list | None, source: str = "target") -> None:
        """One token event; raw_probs [V] is the T=1 distribution it came from (for top_logprobs)."""
        if not self.bus.wants("token"):
            return
        fields = {"request_id": req.request_id, "seq_id": seq.seq_id, "position": len(seq),
                  "token_id": token, "text": self.token_text(token), "logprob": logprob, "source": source}
        p = req.params
        if top is not None:
            fields["dist"] = {"top": top, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                              "min_p": p.min_p}
        if p.logprobs and raw_probs is not None:
            best = raw_probs.topk(p.logprobs)
            fields["top_logprobs"] = [[t, self.token_text(t), math.log(max(pr, 1e-45))]
                                      for t, pr in zip(best.indices.tolist(), best.values.tolist())]
        self.bus.emit("token", **fields)

    def _top_tokens(self, raw_probs: torch.Tensor, final_probs: torch.Tensor, chosen: list[int]) -> list[list[list]]:
        """Per row of [B, V]: the top N by raw probability, plus the chosen token and EOS when not among them.

        One topk and one gather for the whole batch: this runs every step when events are full."""
        chosen_ids = torch.tensor(chosen, device=raw_probs.device)[:, None]  # [B, 1]
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=raw_probs.device).expand(len(chosen), -1)
        ids = torch.cat((raw_probs.topk(self.config.dist_top_n).indices, chosen_ids, eos), dim=1)  # [B, N+1+E]
        raw = raw_probs.gather(1, ids).tolist()
        final = final_probs.gather(1, ids).tolist()
        rows = []
        for r, row_ids in enumerate(ids.tolist()):
            seen: set[int] = set()
            rows.append([[t, self.token_text(t), raw[r][i], final[r][i]]
                         for i, t in enumerate(row_ids) if not (t in seen or seen.add(t))])
        return rows

    def _emit_metrics(self) -> None:
        live = self.live_sequences()
        usage, waste = self.metrics.kv_snapshot(live, self.blocks.num_used_blocks, self.cache.num_blocks,
                                                self.config.block_size)
        # Blocks that sharing saves: what every table would hold unshared, less the distinct blocks.
        held = [b for s in live for b in s.block_table]
        self.bus.emit("metrics", tokens_per_s=self.metrics.tokens_per_s(), kv_usage=usage, kv_waste=waste,
                      prefix_hit_rate=self.blocks.prefix_hit_rate, num_preemptions=self.scheduler.num_preemptions,
                      num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                      kv_blocks_saved_by_sharing=len(held) - len(set(held)),
                      **(self.spec_stats.summary() if self.proposer else {}))

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.token_text(token)
        return text
