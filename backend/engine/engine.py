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
from backend.engine.block_manager import BlockManager
from backend.engine.kv_cache import DTYPE_NAMES, KVCache, check_kv_dtype, kv_formula, num_blocks_for_budget
from backend.engine.metrics import MetricsTracker, RequestTimes
from backend.engine.request import Request, RequestError, check_fits, check_supported, finish_reason_after
from backend.engine.runner import ModelRunner
from backend.engine.sampler import SamplerOutput, sample
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledSeq, Scheduler
from backend.engine.sequence import Sequence, SeqStatus
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


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, bus: EventBus | None = None, seed: int = 0) -> None:
        if config.speculative is not None:
            raise RequestError("engine.speculative", "speculative decoding is not supported by this engine yet")
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
        self.scheduler = Scheduler(config, self.blocks, self._on_preempt)
        self.runner = ModelRunner(loaded.model.to(self.device), self.cache, self.attention_backend)
        self.metrics = MetricsTracker()
        self.requests: dict[str, Request] = {}
        self.unfinished: dict[int, Request] = {}  # seq_id -> request
        self.step_no = 0
        self._next_seq_id = 0
        self._token_text: dict[int, str] = {}

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
        check_supported(params)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if any(not 0 <= t < self.loaded.config.vocab_size for t in ids):
            raise RequestError("prompt", f"token ids must lie in [0, {self.loaded.config.vocab_size})")
        check_fits(self.config, self.cache.num_blocks, len(ids), max_tokens)
        seq = Sequence(self._next_seq_id, request_id, list(ids), len(ids))
        self._next_seq_id += 1
        seed = params.seed if params.seed is not None else self.seed * 1_000_003 + seq.seq_id
        req = Request(request_id, ids, prompt if isinstance(prompt, str) else self.tokenizer.decode(ids),
                      max_tokens, params, torch.Generator().manual_seed(seed), self.step_no,
                      RequestTimes(time.perf_counter()), seq)
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
        logits = self.runner.execute(out.scheduled, out.block_copies) if out.scheduled else None
        for item in out.scheduled:
            item.seq.num_computed_tokens = item.context_len
            self.blocks.commit_computed(item.seq)
        sampling = [item for item in out.scheduled if item.samples]
        now = time.perf_counter()
        self._emit_iteration(out.scheduled, out.num_batched_tokens, now - started)
        if sampling:
            self._sample_and_append(sampling, logits, now)
        prefill = sum(i.num_tokens for i in out.scheduled if i.phase == "prefill")
        self.metrics.on_iteration(now, prefill, len(sampling))
        self._emit_metrics()
        self.step_no += 1

    def _sample_and_append(self, items: list[ScheduledSeq], logits: torch.Tensor, now: float) -> None:
        reqs = [self.unfinished[item.seq.seq_id] for item in items]
        result = sample(logits, [r.params for r in reqs], [r.generator for r in reqs], self.eos_ids,
                        [r.seq.token_ids for r in reqs], [r.seq.output_token_ids for r in reqs])
        tops = self._top_tokens(result) if self.bus.wants_dist else None
        for row, req in enumerate(reqs):
            token = result.token_ids[row]
            self._emit_token(req, row, token, result, tops[row] if tops else None)
            req.seq.token_ids.append(token)
            req.times.num_output_tokens += 1
            if req.times.first_token is None:
                req.times.first_token = now
            reason = finish_reason_after(req, token, self.eos_ids, self.config.max_model_len, self.tokenizer)
            if reason:
                self._finish(req, reason)

    def _finish(self, req: Request, reason: str, why: str | None = None) -> None:
        req.finish_reason, req.abort_reason = reason, why
        req.times.finish = time.perf_counter()
        req.seq.status = SeqStatus.FINISHED
        self.scheduler.remove(req.seq)
        self.unfinished.pop(req.seq.seq_id, None)
        if not req.stop_hit:
            req.output_text = self.tokenizer.decode([t for t in req.seq.output_token_ids if t not in self.eos_ids])
        t = req.times
        self.bus.emit("request_finished", request_id=req.request_id, seq_id=req.seq.seq_id, finish_reason=reason,
                      reason=why, output_token_ids=req.seq.output_token_ids, output_text=req.output_text,
                      ttft_s=t.ttft(), tpot_s=t.tpot(), e2e_s=t.e2e(),
                      num_cached_prompt_tokens=req.seq.num_cached_prompt_tokens)

    def _abort_impossible(self) -> None:
        """A sequence that has outgrown the whole cache can never run again: end it, let the rest go on."""
        for req in list(self.unfinished.values()):
            need = math.ceil((len(req.seq) + 1) / self.config.block_size)
            if need > self.cache.num_blocks:
                self._finish(req, "abort", f"needs {need} KV blocks, the cache has {self.cache.num_blocks}")

    def _on_preempt(self, seq: Sequence, num_blocks: int) -> None:
        self.bus.emit("preempt", request_id=seq.request_id, seq_id=seq.seq_id, num_blocks_freed=num_blocks,
                      mode="recompute")

    # ---- events -------------------------------------------------------------------------------------

    def _emit_iteration(self, batch: list[ScheduledSeq], num_tokens: int, duration: float) -> None:
        self.bus.emit(
            "iteration",
            batch=[{"request_id": i.seq.request_id, "seq_id": i.seq.seq_id, "phase": i.phase,
                    "num_query_tokens": i.num_tokens, "context_len": i.context_len} for i in batch],
            num_batched_tokens=num_tokens, token_budget=self.config.max_num_batched_tokens,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks, duration_s=duration, max_num_seqs=self.config.max_num_seqs,
        )
        if self.bus.wants("attention_mask"):
            for i in batch:
                begin = i.context_len - i.num_tokens
                kind = "decode" if i.phase == "decode" else ("chunked_prefill" if begin > 0 else "prefill")
                self.bus.emit("attention_mask", request_id=i.seq.request_id, seq_id=i.seq.seq_id, kind=kind,
                              query_positions=[begin, i.context_len], key_len=i.context_len)

    def _emit_token(self, req: Request, row: int, token: int, result: SamplerOutput, top: list | None) -> None:
        if not self.bus.wants("token"):
            return
        fields = {"request_id": req.request_id, "seq_id": req.seq.seq_id, "position": len(req.seq),
                  "token_id": token, "text": self.token_text(token), "logprob": result.logprobs[row],
                  "source": "target"}
        p = req.params
        if top is not None:
            fields["dist"] = {"top": top, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                              "min_p": p.min_p}
        if p.logprobs:
            best = result.raw_probs[row].topk(p.logprobs)
            fields["top_logprobs"] = [[t, self.token_text(t), math.log(max(pr, 1e-45))]
                                      for t, pr in zip(best.indices.tolist(), best.values.tolist())]
        self.bus.emit("token", **fields)

    def _top_tokens(self, result: SamplerOutput) -> list[list[list]]:
        """Per row: the top N by raw probability, plus the chosen token and EOS when not among them.

        One topk and one gather for the whole batch: this runs every step when events are full."""
        chosen = torch.tensor(result.token_ids, device=result.raw_probs.device)[:, None]  # [B, 1]
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=chosen.device).expand(len(chosen), -1)
        ids = torch.cat((result.raw_probs.topk(self.config.dist_top_n).indices, chosen, eos), dim=1)  # [B, N+1+E]
        raw = result.raw_probs.gather(1, ids).tolist()
        final = result.final_probs.gather(1, ids).tolist()
        rows = []
        for r, row_ids in enumerate(ids.tolist()):
            seen: set[int] = set()
            rows.append([[t, self.token_text(t), raw[r][i], final[r][i]]
                         for i, t in enumerate(row_ids) if not (t in seen or seen.add(t))])
        return rows

    def _emit_metrics(self) -> None:
        seqs = [r.seq for r in self.unfinished.values()]
        usage, waste = self.metrics.kv_snapshot(seqs, self.blocks.num_used_blocks, self.cache.num_blocks,
                                                self.config.block_size)
        self.bus.emit("metrics", tokens_per_s=self.metrics.tokens_per_s(), kv_usage=usage, kv_waste=waste,
                      prefix_hit_rate=self.blocks.prefix_hit_rate, num_preemptions=self.scheduler.num_preemptions,
                      num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting))

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.token_text(token)
        return text
