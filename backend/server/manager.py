"""The runs a server holds: start them from scenarios or traces, find them, and the API's own run."""

from __future__ import annotations

import json
import threading
from typing import Any

from backend.config import EngineConfig, ModelConfig
from backend.errors import ModelLoadError
from backend.model.loader import SHIPPED_MODELS, SHIPPED_MODELS_DIR, SMOLLM2, missing_package, read_config, \
    resolve_model_dir
from backend.model.tokenizer import read_chat_template
from backend.scenario import Scenario, apply_overrides, load_scenario, validate
from backend.server.replay import ReplayRun
from backend.server.runs import DEFAULT_SPEED, EngineRun, RunError, ServedRun, build_run

MAX_RUNS = 16  # finished runs beyond this are forgotten, oldest first
API_RUN_ID = "api"  # the server's own model; another model named by an API request gets "api-<name>"
# A model outside the shipped demos gets its KV cache by bytes: SmolLM2 in fp32 (46 KB per token)
# holds ~5,800 tokens in 256 MB, where a fixed 1024 blocks would take 755 MB.
API_KV_CACHE_MB = 256.0


def api_engine(model: str) -> EngineConfig:
    """A demo model's API run gets 1024 blocks (a pool the dashboard can draw); any other a memory budget."""
    if model in SHIPPED_MODELS:
        return EngineConfig(num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=512)
    return EngineConfig(num_blocks=None, kv_cache_memory_mb=API_KV_CACHE_MB, max_num_seqs=16,
                        max_num_batched_tokens=512)


def describe_config(config: ModelConfig) -> str:
    """One line for a model picker: its attention variant and size, from its config."""
    if config.mla is not None:
        heads = f"{config.num_attention_heads} heads, latent KV of {config.mla.kv_lora_rank}"
    else:
        kv = config.num_key_value_heads
        heads = f"{config.num_attention_heads} query / {kv} KV head{'s' if kv > 1 else ''}"
    return f"{config.attention.upper()} · {config.num_hidden_layers} layers × {config.hidden_size} · {heads}"


def model_entry(name: str, served: bool) -> dict:
    """What GET /api/models says of one model: installed (else the install command), description, chat template."""
    install = missing_package(name)
    entry = {"name": name, "installed": served and install is None, "install": install, "chat_template": False,
             "description": f"not installed (run: {install})" if install else "its weights are missing"}
    if not entry["installed"]:
        return entry
    try:
        # A GGUF file is converted here the first time (~10 s for SmolLM2): a run would convert it anyway.
        model_dir = resolve_model_dir(name)
        entry.update(description=describe_config(read_config(model_dir)),
                     chat_template=read_chat_template(model_dir) is not None)
    except ModelLoadError as e:  # the server's own model, named by a path that no longer loads
        entry.update(installed=False, description=str(e))
    return entry


class RunManager:
    def __init__(self, default_model: str = "demo", watcher_queue_limit: int | None = None) -> None:
        self.default_model = default_model
        self.watcher_queue_limit = watcher_queue_limit
        self.runs: dict[str, ServedRun] = {}
        self._lock = threading.Lock()

    def get(self, run_id: str) -> ServedRun | None:
        return self.runs.get(run_id)

    def start_scenario(self, scenario: str | dict[str, Any], overrides: dict[str, Any] | None = None,
                       speed: float = DEFAULT_SPEED, paused: bool = False) -> ServedRun:
        resolved = self.resolve(scenario, overrides)
        return self._add(build_run(lambda: EngineRun(resolved, speed, paused)))

    def start_replay(self, events: list[dict], speed: float = DEFAULT_SPEED, paused: bool = False) -> ServedRun:
        return self._add(build_run(lambda: ReplayRun(events, speed, paused)))

    def api_models(self) -> list[str]:
        """Models the OpenAI API serves by name: the server's first, then the shipped ones and smollm2 when present."""
        shipped = [m for m in SHIPPED_MODELS if (SHIPPED_MODELS_DIR / m / "model.safetensors").is_file()]
        names = [self.default_model, *shipped, SMOLLM2]
        return [m for m in dict.fromkeys(names) if m == self.default_model or missing_package(m) is None]

    def models(self) -> list[dict]:
        """Every model known by name (the OpenAI API's, then the shipped ones and smollm2 if absent), for pickers."""
        served = self.api_models()
        names = dict.fromkeys([*served, *SHIPPED_MODELS, SMOLLM2])
        return [model_entry(name, name in served) for name in names]

    def api_run(self, model: str | None = None) -> EngineRun:
        """The open-ended run that OpenAI-compatible requests for `model` join (created on first use)."""
        model = model or self.default_model
        run_id = API_RUN_ID if model == self.default_model else f"{API_RUN_ID}-{model}"
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                # No requests of its own, which a scenario file may not have: built, not validated.
                scenario = Scenario.model_construct(name="api", description="Requests from the OpenAI API.",
                                                    lesson="", model=model, seed=0, engine=api_engine(model),
                                                    requests=[], generate=None)
                run = EngineRun(scenario, speed=0.0, run_id=run_id, open_ended=True).start()
                self.runs[run_id] = run
            assert isinstance(run, EngineRun)
            return run

    def resolve(self, scenario: str | dict[str, Any], overrides: dict[str, Any] | None) -> Scenario:
        """A scenario name or inline object, with dotted overrides applied, validated."""
        if isinstance(scenario, str):
            base = load_scenario(scenario).model_dump(mode="json")
            source = f"scenario {scenario}"
        else:
            base, source = dict(scenario), "scenario"
        items = [(key, value, f"overrides {key}={json.dumps(value)}") for key, value in (overrides or {}).items()]
        return validate(base, source, apply_overrides(base, items))

    def _add(self, run: ServedRun) -> ServedRun:
        with self._lock:
            finished = [rid for rid, r in self.runs.items() if r.finished and rid != API_RUN_ID]
            while len(self.runs) >= MAX_RUNS and finished:
                self.runs.pop(finished.pop(0)).stop()
            if len(self.runs) >= MAX_RUNS:
                raise RunError(None, f"too many runs at once (at most {MAX_RUNS}); let one finish first")
            self.runs[run.run_id] = run
        if self.watcher_queue_limit:
            run.queue_limit = self.watcher_queue_limit
        return run.start()

    def stop_all(self) -> None:
        for run in self.runs.values():
            run.stop()

