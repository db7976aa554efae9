"""The engine: one `step()` is one iteration, four stages, each owned by one part.

    plan = scheduler.schedule()                          who runs (scheduler.py)
    out = executor.execute(scheduler.step_input(plan))   forward and sampling (executor.py)
    outputs = scheduler.update_from_output(plan, out)    the results become state (scheduler.py)
    emit(outputs)                                        events (step_events.py) and the callers' stream

With speculative decoding the update is followed by the draft pass, the same way round:
`scheduler.schedule_drafts()`, `executor.propose(...)`, `scheduler.update_from_drafts(...)`.
The engine knows nothing of HTTP or dashboards: everything it decides goes out as events on its
bus, and each request's own outputs (arrival, forks, tokens, finish) to the sink of `stream_outputs`.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvscope.backend.config import MAX_NUM_BLOCKS, EngineConfig, ModelConfig
from kvscope.backend.engine.admission import prepare
from kvscope.backend.engine.block_manager import BlockManager
from kvscope.backend.engine.dist_rows import DistRows
from kvscope.backend.engine.executor import Executor, Forward
from kvscope.backend.engine.grammar import Grammars
from kvscope.backend.engine.kv_cache import DTYPE_NAMES, KVCache, kv_dtype_name, kv_formula, num_blocks_for_budget
from kvscope.backend.engine.metrics import MetricsTracker, SpecStats
from kvscope.backend.engine.request import Request, RequestError
from kvscope.backend.engine.request_output import Arrived, EngineOutput, Finished, Forked, Rejected, Sink, Token, ignore
from kvscope.backend.engine.runner import ModelRunner
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.engine.scheduler import Moving, Numbering, Role, Scheduler
from kvscope.backend.engine.scheduler_output import SchedulerOutput
from kvscope.backend.engine.sequence import Sequence
from kvscope.backend.engine.speculative import DraftModelProposer, make_proposer
from kvscope.backend.engine.step_events import StepEvents
from kvscope.backend.engine.step_output import DraftOutput, StepOutput
from kvscope.backend.engine.tp_runner import start_tensor_parallel
from kvscope.backend.errors import KvscopeError
from kvscope.backend.events.bus import EventBus
from kvscope.backend.events.schema import SCHEMA_VERSION
from kvscope.backend.model.loader import LoadedModel, load_model
from kvscope.backend.model.quant import QuantError, gguf_summary, quantize_loaded
from kvscope.backend.model.sharding import check_tensor_parallel, shard_config, shard_plan
from kvscope.backend.model.weights import WeightCache

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

REQUEST_OUTPUTS = (Arrived, Forked, Token, Finished)  # what a caller's sink gets; the rest is for the events


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


def check_compile_decode(config: EngineConfig, attention_backend: str) -> None:
    """The compiled decode step is the torch backend's, on one rank: anything else is refused, not ignored."""
    if not config.compile_decode:
        return
    if attention_backend != "torch":
        raise RequestError("engine.compile_decode", "compiles the torch attention backend's decode step; set "
                                                    "attention_backend torch (the Triton kernels run as they are)")
    if config.tensor_parallel > 1:
        raise RequestError("engine.compile_decode", "runs on one rank: a tensor-parallel rank's step all-reduces "
                                                    "inside the model, which the compiled graph does not hold")


def check_kv_dtype(kv_dtype: str, config: ModelConfig, attention_backend: str) -> None:
    """Refuse KV cache dtypes no attention path implements for this model."""
    if kv_dtype == "int8" and config.mla is not None and attention_backend == "triton":
        raise RequestError("engine.kv_cache_dtype",
                           "int8 KV with MLA needs attention_backend torch: the Triton MLA decode kernel "
                           "(kernels/mla_decode.py) reads no int8 scales")


@dataclass
class Runtime:
    """What the step runs the model with: KV storage, a runner, a clock, and what the header says of them.

    A real run builds it from the weights (`load_runtime`). Simulate mode (backend/perf/simulate.py)
    injects its own: a cache with no tensors, a runner that prices each batch with the cost model
    instead of computing it, and the modelled clock that runner advances. The step never asks which.
    """

    cache: KVCache  # or anything with its sizes: num_blocks, block_size, dtype, storage_dtype, bytes_per_*
    runner: Forward  # logits(StepInput) -> [len(logit_rows), V]: a ModelRunner, or what stands in for one
    device: str
    attention_backend: str
    weights: dict | None = None  # the header's `weights`
    clock: Callable[[], float] = time.perf_counter  # times iterations and requests (TTFT, TPOT)
    header: dict = field(default_factory=dict)  # extra header fields (simulate mode: `simulated`)
    iteration_fields: Callable[[], dict] = dict  # extra fields of the next `iteration` event
    close: Callable[[], None] = lambda: None  # frees what outlives the engine object (tensor-parallel ranks)
    compile_s: float = 0.0  # seconds compiling the decode graph took at start (engine.compile_decode)


def load_runtime(loaded: LoadedModel, config: EngineConfig, shared: WeightCache | None = None) -> Runtime:
    """The real runtime: weights (quantized as configured) on the device, a KV cache of real tensors.

    `shared`: the cache `loaded` came from, whose quantized copy runs of the same settings share;
    without it the engine quantizes a copy of its own."""
    if config.weight_quant != "none" and loaded.gguf_types is not None:
        raise RequestError("engine.weight_quant", f"{loaded.name} runs the GGUF file's own quantized weights "
                                                  f"({gguf_summary(loaded.gguf_types)}); to quantize its de-quantized "
                                                  "floats instead, load it with weights float32 (--weights float32)")
    try:  # weight_quant: run a quantized copy; the caller's LoadedModel (the server shares it) is untouched
        loaded, weights = (shared.quantized(loaded, config.weight_quant, config.quant_group_size, config.weights)
                           if shared is not None else quantize_loaded(loaded, config.weight_quant, config.quant_group_size))
    except QuantError as e:
        raise RequestError(e.field, e.reason) from None
    dtype = next(loaded.model.parameters()).dtype
    device = pick_device(config)
    attention_backend = pick_attention_backend(config, device)
    check_kv_dtype(config.kv_cache_dtype, loaded.config, attention_backend)
    world = config.tensor_parallel
    check_compile_decode(config, attention_backend)
    try:
        check_tensor_parallel(loaded.config, world)
    except KvscopeError as e:
        raise RequestError(e.field, e.reason) from None
    rank_config = shard_config(loaded.config, shard_plan(loaded.config, 0, world))  # what rank 0's KV pool holds
    num_blocks = config.num_blocks or num_blocks_for_budget(
        rank_config, config.block_size, config.kv_cache_memory_mb, kv_dtype_name(config.kv_cache_dtype, dtype))
    if num_blocks > MAX_NUM_BLOCKS:  # what num_blocks may say, and the pool every trace of the run is read with
        raise RequestError("engine.kv_cache_memory_mb", f"{config.kv_cache_memory_mb:g} MB holds {num_blocks:,} blocks "
                                                        f"of {config.block_size} tokens; an engine has at most "
                                                        f"{MAX_NUM_BLOCKS:,} (raise engine.block_size, or set "
                                                        "engine.num_blocks)")
    if world > 1:
        try:
            runner, cache = start_tensor_parallel(loaded.model, {"num_blocks": num_blocks, "block_size": config.block_size,
                                                                 "dtype": dtype, "kv_dtype": config.kv_cache_dtype},
                                                  attention_backend, device, world, config.tensor_parallel_timeout_s,
                                                  config.batch_invariant)
        except KvscopeError as e:  # a quantization group a rank's slice would cut
            raise RequestError(e.field, e.reason) from None
        return Runtime(cache, runner, str(device), attention_backend, weights, header={"tensor_parallel": runner.layout},
                       iteration_fields=runner.allreduce_fields, close=runner.close)
    cache = KVCache(loaded.config, num_blocks, config.block_size, dtype, device, config.kv_cache_dtype)
    runner = ModelRunner(loaded.model.to(device), cache, attention_backend, compile=config.compile_decode,
                         batch_invariant=config.batch_invariant)
    return Runtime(cache, runner, str(device), attention_backend, weights, compile_s=runner.compile_s)


@dataclass(frozen=True)
class StepTimes:
    duration_s: float  # the whole step so far: scheduling and executing
    execute_s: float  # the executor's part of it
    ended: float  # the clock when the batch's results were in


@dataclass(frozen=True)
class EngineStats:
    """What a server decides by (admission, shutdown, its gauges): counted by the engine itself, never read
    from the events, which may be off. A snapshot replaced whole after every step, add and abort, so that
    another thread reads a consistent one without a lock."""

    num_running: int = 0  # requests with a sequence in the running batch
    num_waiting: int = 0  # unfinished requests with none running (queued, or preempted)
    num_blocks_used: int = 0
    num_blocks: int = 1
    num_preemptions: int = 0

    @property
    def kv_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks


class Engine:
    """One model, one KV cache, one queue of requests: a scheduler, an executor, and the events."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, bus: EventBus | None = None, seed: int = 0,
                 draft: LoadedModel | None = None, runtime: Runtime | None = None,
                 shared: WeightCache | None = None, role: Role = "both", numbering: Numbering | None = None,
                 block_offset: int = 0) -> None:
        """role, numbering, block_offset: an instance of a disaggregated engine (disaggregated.py): what it
        runs, the sequence ids and arrival numbers its instances share, and where its blocks' numbers
        start in the events."""
        if config.speculative is not None and not config.kv_cache:
            raise RequestError("engine.speculative", "speculative decoding verifies against the KV cache: "
                                                     "it needs kv_cache: true")
        self.runtime = runtime or load_runtime(loaded, config, shared)
        self.loaded, self.config, self.seed = loaded, config, seed
        self.bus = bus or EventBus(level=config.events)
        self.bus.level = config.events
        self.cache, self.clock = self.runtime.cache, self.runtime.clock
        self.device, self.attention_backend = self.runtime.device, self.runtime.attention_backend
        self.weights = self.runtime.weights
        tokenizer, vocab_size = loaded.tokenizer, loaded.config.vocab_size
        self.scheduler = Scheduler(config, self.cache.num_blocks, tokenizer, seed, self.clock, role, numbering)
        proposer = make_proposer(config, vocab_size, draft, self.cache, self.attention_backend,
                                 shared.model if shared else load_model) if config.speculative else None
        self.executor = Executor(self.runtime.runner, proposer)
        self.events = StepEvents(self.bus, config, tokenizer, block_offset)
        self.grammars = Grammars(tokenizer, vocab_size, tokenizer.eos_token_ids)
        self.metrics = MetricsTracker()
        self.step_no = 0
        self.stats = EngineStats(num_blocks=self.cache.num_blocks)
        self._sink: Sink = ignore

    # ---- one iteration ------------------------------------------------------------------------------

    def step(self) -> None:
        """One iteration: schedule -> execute -> update -> emit (then the drafts for the next one)."""
        self.bus.step = self.step_no
        plan, out, timed = self.plan_and_execute()
        self.events.iteration(plan, timed.duration_s, timed.execute_s, self.runtime.iteration_fields())
        self.update(plan, out, timed.ended)
        s = self.scheduler
        self.events.metrics(self.metrics.tokens_per_s(), self.metrics.observe_kv(s.live_sequences(), s.blocks),
                            s.blocks.prefix_hit_rate, s.num_preemptions, len(s.running), len(s.waiting),
                            s.spec_stats.summary() if self.config.speculative else {})
        self.step_no += 1

    # A disaggregated engine (disaggregated.py) runs each of its instances through these two stages, and
    # writes the iteration and metrics events of all of them itself.

    def plan_and_execute(self) -> tuple[SchedulerOutput, StepOutput, StepTimes]:
        """Schedule (its block changes go out as events) and run the batch; nothing is state yet."""
        started = self.clock()
        plan = self.scheduler.schedule(started)
        self._emit(plan.outputs)
        executing = self.clock()
        out = self.executor.execute(self.scheduler.step_input(plan, *self.events.observing())) if plan.rows \
            else StepOutput([])
        now = self.clock()
        return plan, out, StepTimes(now - started, now - executing, now)

    def update(self, plan: SchedulerOutput, out: StepOutput, now: float) -> int:
        """The step's results become state and events (then the drafts for the next step); returns the
        tokens it appended."""
        outputs = self.scheduler.update_from_output(plan, out)
        self._emit(outputs)
        if self.config.speculative:
            drafts = self.scheduler.schedule_drafts()
            proposed = self.executor.propose(drafts) if drafts.rows else DraftOutput()
            self._emit(self.scheduler.update_from_drafts(drafts, proposed))
        appended = sum(isinstance(o, Token) for o in outputs)
        self.metrics.on_iteration(now, plan.num_prefill_tokens, appended)
        self._count()
        return appended

    def _emit(self, outputs: list[EngineOutput]) -> None:
        """The outputs as events, in order, and a request's own ones to the caller's sink."""
        self.events.emit(outputs)
        for output in outputs:
            if isinstance(output, REQUEST_OUTPUTS):
                self._sink(output)

    def _count(self) -> None:
        running = {seq.request_id for seq in self.scheduler.running}
        unfinished = {seq.request_id for seq in self.scheduler.live.values()}
        self.stats = EngineStats(len(running), len(unfinished - running), self.scheduler.blocks.num_used_blocks,
                                 self.cache.num_blocks, self.scheduler.num_preemptions)

    # ---- a disaggregated engine's handoff (disaggregated.py): its scheduler's, with their events --------

    def adopt(self, moving: Moving) -> dict[int, int] | None:
        here, outputs = self.scheduler.adopt(moving)
        self._emit(outputs)
        self._count()
        return here

    def release(self, moving: Moving) -> None:
        self._emit(self.scheduler.release(moving))
        self._count()

    # ---- requests -----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], max_tokens: int,
                    sampling: SamplingParams | dict | None = None, arrival: float | None = None,
                    grammar: CompiledGrammar | None = None) -> Request:
        """Queue a request, or refuse it (RequestError naming the field; a request_rejected event).

        arrival: when it was received, read from `self.clock` (default: now); TTFT and queue time count from it.
        grammar: its structured output compiled by the caller (`self.grammars.compiled`, on a thread of its
        own): the stepping thread then compiles nothing."""
        try:
            if request_id in self.scheduler.requests:
                raise RequestError("id", f"duplicate request id {request_id!r}")
            new = prepare(request_id, prompt, max_tokens, sampling, self.config, self.cache.num_blocks,
                          self.loaded.tokenizer, self.grammars, self.clock() if arrival is None else arrival, grammar)
        except RequestError as e:
            self._emit([Rejected(request_id, e.field, e.reason)])
            raise
        self._emit(self.scheduler.add_request(new, self.step_no))
        self._count()
        return self.scheduler.requests[request_id]

    def abort(self, request_id: str, reason: str = "aborted by the user") -> None:
        self._emit(self.scheduler.abort(request_id, reason))
        self._count()

    def abort_all(self, reason: str) -> None:
        """End every unfinished request (finish_reason abort): a server shutting down."""
        for request_id in dict.fromkeys(seq.request_id for seq in list(self.scheduler.live.values())):
            self.abort(request_id, reason)

    def forget(self, request_id: str) -> None:
        """Drop a finished request from `requests` (its events are out; the open-ended API run calls this)."""
        self.scheduler.forget(request_id)

    def keep_rows(self, rows: DistRows) -> None:
        """A served run's store of whole raw rows (the sampling view's what-if), filled as tokens go out."""
        self.events.rows = rows

    def stream_outputs(self, sink: Sink) -> None:
        """Hand every request's arrival, forks, tokens and finish to `sink`, on the stepping thread."""
        self._sink = sink

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.live)

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_hit_rate(self) -> float:
        return self.scheduler.blocks.prefix_hit_rate

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def spec_stats(self) -> SpecStats:
        return self.scheduler.spec_stats

    def live_sequences(self) -> list[Sequence]:
        """Every sequence holding blocks or waiting for them: the requests' and the draft model's."""
        return self.scheduler.live_sequences()

    def token_text(self, token: int) -> str:
        return self.events.token_text(token)

    def close(self) -> None:
        """Free what the engine holds outside this process's memory: a tensor-parallel engine's other ranks.
        Idempotent; an engine that is never closed frees them when it is collected, or when this process ends."""
        self.runtime.close()

    # ---- the header: what a trace needs to make sense of everything after it ----------------------

    def emit_header(self, scenario: dict | None = None, model_name: str | None = None, num_blocks: int | None = None,
                    **fields) -> None:
        """num_blocks, fields: a disaggregated engine's: the blocks of every instance's pool, and its own fields."""
        c = self.loaded.config
        dtype, kv_dtype = DTYPE_NAMES[self.cache.dtype], DTYPE_NAMES[self.cache.storage_dtype]
        self.bus.emit(
            "header", schema_version=SCHEMA_VERSION, run_id=uuid.uuid4().hex[:12], scenario=scenario,
            config=self.config.model_dump(), attention_backend=self.attention_backend, device=self.device,
            model={"name": model_name or self.loaded.name, "n_layers": c.num_hidden_layers,
                   "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                   "attention": c.attention, "vocab_size": c.vocab_size, "dtype": dtype,
                   "kv_bytes_per_token": self.cache.bytes_per_token, "eos_token_ids": self.scheduler.eos_ids,
                   "config": c.model_dump(mode="json")},
            cache={"num_blocks": num_blocks or self.cache.num_blocks, "block_size": self.cache.block_size,
                   "dtype": kv_dtype, "bytes_per_block": self.cache.bytes_per_block, "formula": kv_formula(c, kv_dtype)},
            weights=self.weights, **self._draft_header(), **self.runtime.header, **fields,
        )

    def _draft_header(self) -> dict:
        """The draft model's size and cache, when one runs beside the target."""
        proposer = self.executor.proposer
        if not isinstance(proposer, DraftModelProposer):
            return {}
        c, cache = proposer.runner.model.config, proposer.cache
        return {"draft_model": {"name": self.config.speculative.draft_model, "n_layers": c.num_hidden_layers,
                                "kv_bytes_per_token": cache.bytes_per_token, "bytes_per_block": cache.bytes_per_block}}
