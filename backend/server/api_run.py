"""The OpenAI API's run: an engine on one model and an EngineConfig, open for requests forever.

Nothing is planned: every request comes over HTTP (openai_api.py, responses_api.py) or from the
dashboard. It runs unpaced, forgets each request after the step that finished it (so that its memory
stays bounded whatever its age), and resumes rather than expire when left paused: it is the service.
Its trace header names it as the dashboard knows it (`API_SCENARIO`, no requests of its own:
RunState.serves_api), so that its views show the engine's own clock per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.disaggregated import build_engine
from kvscope.backend.events.state import API_SCENARIO
from kvscope.backend.model.loader import SHIPPED_MODELS
from kvscope.backend.model.weights import WeightCache
from kvscope.backend.server.engine_run import EngineRun
from kvscope.backend.server.runs import Retention

# A model outside the shipped demos gets its KV cache by bytes: SmolLM2 in fp32 (46 KB per token)
# holds ~5,800 tokens in 256 MB, where a fixed 1024 blocks would take 755 MB.
API_KV_CACHE_MB = 256.0


@dataclass(frozen=True)
class ApiEngineFlags:
    """`kvscope serve`'s engine flags: every API run is built with them (`api_engine`)."""

    weights: str = "native"  # --weights: how a GGUF file's weights run
    tensor_parallel: int = 1  # --tensor-parallel
    compile_decode: bool = False  # --compile-decode
    batch_invariant: bool = False  # --batch-invariant
    disaggregation: dict | None = None  # --prefill-instances, --decode-instances, --router
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: float16 fits twice a float32 cache's tokens in the same MB


def api_engine(model: str, events: str = "full", flags: ApiEngineFlags = ApiEngineFlags()) -> EngineConfig:
    """A demo model's API run gets 1024 blocks (a pool the dashboard can draw); any other a memory budget."""
    shared = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "events": events,
              "tensor_parallel": flags.tensor_parallel, "compile_decode": flags.compile_decode,
              "batch_invariant": flags.batch_invariant, "disaggregation": flags.disaggregation,
              "kv_cache_dtype": flags.kv_cache_dtype}
    if model in SHIPPED_MODELS:
        return EngineConfig(num_blocks=1024, **shared)
    return EngineConfig(num_blocks=None, kv_cache_memory_mb=API_KV_CACHE_MB, weights=flags.weights, **shared)


def api_header_scenario(model: str, seed: int) -> dict[str, Any]:
    """What the trace header's `scenario` says of an API run: its name, and that it has no requests of its own."""
    return {"name": API_SCENARIO, "description": "Requests from the OpenAI API.", "model": model, "seed": seed,
            "requests": [], "generate": None}


class ApiRun(EngineRun):
    """The open-ended run that the OpenAI-compatible requests for one model join."""

    kind = "api"

    def __init__(self, model: str, config: EngineConfig, run_id: str, retention: Retention,
                 weights: WeightCache, seed: int = 0) -> None:
        super().__init__(run_id, config.events, speed=0.0, paused=False, retention=retention, lesson=False,
                         forgets_finished=True)
        loaded = weights.model(model, config.weights)  # shared with every run of the same model and settings
        engine = build_engine(loaded, config, self.bus, seed=seed, shared=weights)
        engine.emit_header(api_header_scenario(model, seed), model)
        self.serve(engine, model)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def _advance(self) -> None:
        self.engine.step()
        for rid in self.requests.take_finished():  # after the step: the engine may still read a request it finished
            self.engine.forget(rid)

    def expire(self) -> bool:
        self.pacing.paused = False  # the service resumes rather than leave requests waiting
        with self.lock:
            self.viewers.forget_resyncs()
        self.bus.emit("control", action="resume", value=None)
        return False
