"""What a long-lived server allows: KV memory, runs, queues, viewers, time, and which models and files.

Every limit is checked before anything is allocated, and going past one is a 400 (or, for a full
queue, a 429) that names the field and the limit: never an allocation attempt, never a 500.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvscope.backend.engine.kv_cache import DTYPE_NAMES, kv_bytes_per_token, num_blocks_for_budget
from kvscope.backend.model.loader import SHIPPED_MODELS, SMOLLM2, LoadedModel
from kvscope.backend.scenario import Scenario

MB = 1024**2
KV_SHARE_OF_MEMORY = 0.25  # of physical memory, for every run's KV cache together: the model, Python
# and the other programs on the machine need the rest


def physical_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MB


@dataclass
class ServiceLimits:
    """The server's limits (kvscope serve's flags); the defaults suit a server left running."""

    max_kv_memory_mb: float = field(default_factory=lambda: physical_memory_mb() * KV_SHARE_OF_MEMORY)
    max_run_kv_memory_mb: float | None = None  # one run's ceiling; None: the total
    max_runs: int = 16  # runs held at once (finished ones are forgotten first to make room)
    max_waiting: int = 64  # requests queued in one run before /v1 answers 429
    request_timeout_s: float = 600.0  # a /v1 request is aborted after this long
    max_viewers: int = 32  # websocket viewers per run
    viewer_events_per_s: float = 4000.0  # sent to all viewers together: the engine and /v1 keep the CPU
    paused_ttl_s: float = 900.0  # a paused run untouched this long expires (the api run resumes instead)
    history: int = 256  # finished requests a run keeps in memory (and in its snapshot)
    trace_window: int = 20_000  # events a run keeps in memory for /trace (the whole trace: trace_dir)
    trace_dir: str | None = None  # write each engine run's whole trace to <trace_dir>/<run_id>.jsonl
    allow_paths: bool = False  # scenario files and model folders named by clients
    served_models: tuple[str, ...] = ()  # models given on the command line, by name

    @property
    def run_kv_ceiling_mb(self) -> float:
        return min(self.max_run_kv_memory_mb or self.max_kv_memory_mb, self.max_kv_memory_mb)

    def model_names(self) -> tuple[str, ...]:
        return (*SHIPPED_MODELS, SMOLLM2, *(m for m in self.served_models if m not in SHIPPED_MODELS + (SMOLLM2,)))


def kv_cache_bytes(scenario: Scenario, loaded: LoadedModel, draft: LoadedModel | None = None) -> int:
    """The bytes the scenario's engine will allocate for KV caches (the draft model's included), by the
    engine's own formula: what Engine.__init__ would size, computed before building it."""
    engine = scenario.engine
    kv_dtype = "int8" if engine.kv_cache_dtype == "int8" else DTYPE_NAMES[next(loaded.model.parameters()).dtype]
    blocks = engine.num_blocks or num_blocks_for_budget(loaded.config, engine.block_size,
                                                        engine.kv_cache_memory_mb, kv_dtype)
    per_token = kv_bytes_per_token(loaded.config, kv_dtype)
    if draft is not None:  # the draft's cache has the target's blocks (speculative_steps._make_proposer)
        draft_dtype = "int8" if engine.kv_cache_dtype == "int8" else DTYPE_NAMES[next(draft.model.parameters()).dtype]
        per_token += kv_bytes_per_token(draft.config, draft_dtype)
    return blocks * engine.block_size * per_token
