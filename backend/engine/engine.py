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
from backend.engine.beam_search import BeamState
from backend.engine.block_manager import BlockManager
from backend.engine.kv_cache import DTYPE_NAMES, KVCache, check_kv_dtype, kv_formula, num_blocks_for_budget
from backend.engine.metrics import MetricsTracker, RequestTimes
from backend.engine.request import (Request, RequestError, check_fits, check_supported, check_token_ids,
                                    finish_reason_after)
from backend.engine.runner import ModelRunner
from backend.engine.sampler import sample
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledSeq, Scheduler
from backend.engine.sequence_groups import SequenceGroups
from backend.engine.speculative import SpecStats
from backend.engine.speculative_steps import SpeculativeSteps
from backend.engine.sequence import Sequence
from backend.events.bus import EventBus
from backend.events.schema import SCHEMA_VERSION
from backend.model.loader import LoadedModel
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


class Engine(SpeculativeSteps, SequenceGroups):
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

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

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
        check_token_ids(params, self.loaded.config.vocab_size)
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
            self._abort_request(req, reason)

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
                        [seq.token_ids for seq in seqs], [seq.num_prompt_tokens for seq in seqs])
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

    def _abort_impossible(self) -> None:
        """A sequence that has outgrown the whole cache can never run again: end it, let the rest go on."""
        for seq in self.live_sequences():
            if seq.seq_id not in self.unfinished:
                continue  # a draft model's shadow: it goes with its target sequence
            need = math.ceil((len(seq) + 1) / self.config.block_size)
            req = self.requests[seq.request_id]
            if need > self.cache.num_blocks and req.finish_reason is None:
                self._abort_request(req, f"needs {need} KV blocks, the cache has {self.cache.num_blocks}")

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
        texts, rows = self._token_text, []
        for r, row_ids in enumerate(ids.tolist()):
            first: dict[int, int] = {}  # token -> its first column (the chosen token or EOS may repeat a top one)
            for i, t in enumerate(row_ids):
                first.setdefault(t, i)
            rows.append([[t, texts.get(t) or self.token_text(t), raw[r][i], final[r][i]] for t, i in first.items()])
        return rows

    def _emit_metrics(self) -> None:
        live = self.live_sequences()
        usage, waste = self.metrics.kv_snapshot(live, self.blocks.num_used_blocks, self.cache.num_blocks,
                                                self.config.block_size)
        # Blocks that sharing saves: what every table would hold unshared, less the distinct blocks.
        held = [b for s in live for b in s.block_table]
        saved = len(held) - len(set(held))
        self.metrics.on_sharing(saved)
        self.bus.emit("metrics", tokens_per_s=self.metrics.tokens_per_s(), kv_usage=usage, kv_waste=waste,
                      prefix_hit_rate=self.blocks.prefix_hit_rate, num_preemptions=self.scheduler.num_preemptions,
                      num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                      kv_blocks_saved_by_sharing=saved,
                      **(self.spec_stats.summary() if self.proposer else {}))

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.token_text(token)
        return text
