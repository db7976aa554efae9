"""What a long-lived server allows: KV and weight memory, runs, queues, viewers, time, which models and files.

Every limit is checked before anything is allocated, and going past one is a 400 (or, for a full
queue, a 429) that names the field and the limit: never an allocation attempt, never a 500.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from typing import Literal

from kvscope.backend.config import EngineConfig, ModelConfig, kv_storage_dtype
from kvscope.backend.engine.kv_cache import num_blocks_for_budget
from kvscope.backend.model.loader import SHIPPED_MODELS, SMOLLM2, gguf_file, model_facts
from kvscope.backend.model.sharding import check_tensor_parallel, shard_config, shard_plan
from kvscope.backend.model.weights import LOAD_DTYPE, WeightKey
from kvscope.backend.perf.cost_model import embedding_bytes, model_bytes, rank_bytes
from kvscope.backend.perf.shapes import ModelShape, shape_from_config
from kvscope.backend.server.run_errors import RunError

MB = 1024**2
KV_SHARE_OF_MEMORY = 0.25  # of physical memory, for every run's KV cache together: the model, Python
# and the other programs on the machine need the rest
WEIGHT_SHARE_OF_MEMORY = 0.25  # of physical memory, for every weight copy the server holds (models and
# their quantized copies): with the KV caches' quarter, half the machine is the server's at most
REPLAY_SHARE_OF_MEMORY = 0.125  # of physical memory, for the parsed traces replays hold (replay_copies.py)


def physical_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MB


@dataclass
class ServiceLimits:
    """The server's limits (kvscope serve's flags); the defaults suit a server left running."""

    max_kv_memory_mb: float = field(default_factory=lambda: physical_memory_mb() * KV_SHARE_OF_MEMORY)
    max_run_kv_memory_mb: float | None = None  # one run's ceiling; None: the total
    max_weight_memory_mb: float = field(default_factory=lambda: physical_memory_mb() * WEIGHT_SHARE_OF_MEMORY)
    # the replays' parsed traces, shared by the replays of one trace, and their reducers
    max_replay_memory_mb: float = field(default_factory=lambda: physical_memory_mb() * REPLAY_SHARE_OF_MEMORY)
    max_runs: int = 16  # runs held at once (finished ones are forgotten first to make room)
    max_waiting: int = 64  # requests queued in one run before /v1 answers 429
    # Clients' grammars (grammar_compiles.py): a compile waited for at most this long (xgrammar cannot be
    # stopped: one ran ~160 s), at most this many at once server-wide (one more: a 429), and each engine run's
    # cache of compiled grammars within this many MB, by xgrammar's own measure (one can hold ~170 MB).
    grammar_timeout_s: float = 30.0
    max_grammar_compiles: int = 2
    grammar_cache_mb: float = 256.0
    request_timeout_s: float = 600.0  # a /v1 request is aborted after this long
    # The Responses API's `store: true` (response_store.py): conversations kept for previous_response_id
    stored_responses_mb: float = 64.0
    stored_response_ttl_s: float = 3600.0
    max_viewers: int = 32  # websocket viewers per run
    viewer_events_per_s: float = 4000.0  # sent to all viewers together: the engine and /v1 keep the CPU
    paused_ttl_s: float = 900.0  # a paused run untouched this long expires (the api run resumes instead)
    stall_timeout_s: float | None = 300.0  # a run's step (or command) taking longer fails the run; None: never
    history: int = 256  # finished requests a run keeps in memory (and in its snapshot)
    trace_window: int = 20_000  # events a run keeps in memory for /trace (the whole trace: trace_dir)
    # What the API's run records (the trace, the dashboard's views): full, summary or off. Its answers
    # are the same at every level (request_output.py); off spares each served token a top-k, a JSON
    # encoding and a reducer apply.
    api_events: Literal["full", "summary", "off"] = "full"
    trace_dir: str | None = None  # each engine run's whole trace to <trace_dir>/<run_id>.jsonl (or -N, never over one)
    # Ranks one run may start (engine.tensor_parallel): each is a process with its share of the model; the
    # default lets a run use each core once.
    max_tensor_parallel: int = field(default_factory=lambda: max(2, os.cpu_count() or 1))
    allow_paths: bool = False  # scenario files and model folders named by clients
    served_models: tuple[str, ...] = ()  # models given on the command line, by name

    @property
    def run_kv_ceiling_mb(self) -> float:
        return min(self.max_run_kv_memory_mb or self.max_kv_memory_mb, self.max_kv_memory_mb)

    def model_names(self) -> tuple[str, ...]:
        return (*SHIPPED_MODELS, SMOLLM2, *(m for m in self.served_models if m not in SHIPPED_MODELS + (SMOLLM2,)))


class WeightMemoryError(RunError):
    """A run that needs a new weight copy the server has no room for: the client's model or settings to change."""


@dataclass(frozen=True)
class WeightNeed:
    """A weight copy a run would hold: its key, its bytes estimated before loading, the field that asks for it."""

    key: WeightKey
    bytes: int
    field: str


def model_config(name: str) -> ModelConfig:
    """A model's config without loading its weights (a GGUF file: its metadata)."""
    return model_facts(name)[0]


def draft_model(engine: EngineConfig) -> str | None:
    spec = engine.speculative
    return spec.draft_model if spec is not None and spec.method == "draft" else None


def weight_needs(model: str, engine: EngineConfig) -> list[WeightNeed]:
    """The weight copies a run of the model with this engine config holds: the model's own, the quantized
    copy the engine runs (made from the model's own, which the run keeps for its tokenizer and prompt
    logprobs) and a draft model's, each sized from its config before anything is loaded; with tensor
    parallelism, the shards the other ranks hold in their own processes, a copy of this run's alone."""
    draft = draft_model(engine)
    config = model_config(model)
    gguf = gguf_file(model) if engine.weights == "native" else None
    size = gguf.stat().st_size if gguf is not None else weight_copy_bytes(config)  # a GGUF file's layers: about its size
    needs = [WeightNeed(WeightKey(model, weights=engine.weights), size, "model")]
    if engine.weight_quant != "none":
        key = WeightKey.of(model, engine.weight_quant, engine.quant_group_size, engine.weights)
        needs.append(WeightNeed(key, weight_copy_bytes(config, key.quant, key.group_size), "engine.weight_quant"))
    if engine.tensor_parallel > 1:
        needs.append(rank_shards(engine.tensor_parallel, config, needs[-1]))
    if draft is not None:
        needs.append(WeightNeed(WeightKey(draft), weight_copy_bytes(model_config(draft)),
                                "engine.speculative.draft_model"))
    return needs


def rank_shards(ranks: int, config: ModelConfig, engine_copy: WeightNeed) -> WeightNeed:
    """Ranks 1..N-1's shards of the copy the engine runs, scaled from that copy's estimate (a GGUF file's,
    a quantized copy's) by the share of the cost model's bytes each such rank holds."""
    check_tensor_parallel(config, ranks)
    shape = shape_from_config(config.model_copy(update={"torch_dtype": LOAD_DTYPE}))
    share = (ranks - 1) * other_rank_bytes(shape, ranks) / model_bytes(shape)
    key = dataclasses.replace(engine_copy.key, shards_of=uuid.uuid4().hex)  # no other run holds these
    return WeightNeed(key, int(engine_copy.bytes * share), "engine.tensor_parallel")


def other_rank_bytes(shape: ModelShape, ranks: int) -> float:
    """A rank's weights past rank 0 as kvscope shards them (backend/model/sharding.py): its share of every
    layer, the whole embedding, no LM head (the cost model's ranks split both by vocabulary)."""
    embedding = embedding_bytes(shape)
    lm_head = rank_bytes(shape.lm_head(), shape.dtype, "none", 0, ranks) if not shape.config.tie_word_embeddings else 0.0
    return model_bytes(shape, tp=ranks) - embedding / ranks - lm_head + embedding


def weight_copy_bytes(config: ModelConfig, quant: str = "none", group_size: int = 0) -> int:
    """A copy's bytes by the cost model's formula (cost_model.model_bytes), in the dtype the cache loads:
    within 0.3% of the built copy's (norms are left out)."""
    shape = shape_from_config(config.model_copy(update={"torch_dtype": LOAD_DTYPE}))
    return int(model_bytes(shape, quant, group_size))


def kv_cache_bytes(engine: EngineConfig, config: ModelConfig, draft: ModelConfig | None = None) -> int:
    """The bytes an engine of this config will allocate for KV caches (the draft model's included), by the
    engine's own formula: what Engine.__init__ would size, computed from the configs before building it."""
    kv_dtype = kv_storage_dtype(engine.kv_cache_dtype, LOAD_DTYPE)  # "auto": the cache is in the weights' dtype
    check_tensor_parallel(config, engine.tensor_parallel)
    # every rank's pool: its heads, num_blocks blocks each (a KV head replicated on several ranks counts each time)
    ranks = [shard_config(config, shard_plan(config, r, engine.tensor_parallel)) for r in range(engine.tensor_parallel)]
    blocks = engine.num_blocks or num_blocks_for_budget(ranks[0], engine.block_size, engine.kv_cache_memory_mb, kv_dtype)
    per_token = sum(rank.kv_bytes_per_token(kv_dtype) for rank in ranks)
    if draft is not None:  # the draft's cache has the target's blocks (speculative.make_proposer)
        per_token += draft.kv_bytes_per_token(kv_dtype)
    split = engine.disaggregation  # a disaggregated engine's instances each hold a pool of their own
    pools = split.prefill_instances + split.decode_instances if split is not None else 1
    return pools * blocks * engine.block_size * per_token
