"""The runs a server holds: start them from scenarios or traces, find them, and the API's own run.

Every start is checked against the server's limits (limits.py) before anything is built: the KV
bytes its engine would allocate, per run and for all runs together, the bytes of the weight copies
it would add (runs of one model and settings share one), and how many runs are held. Finished runs are
forgotten first to make room; an expired run (paused and untouched too long) is forgotten as its worker
ends (`ServedRun.on_expired`), so that reading the runs never changes them; a forgotten run lets go of
its weight copies. A failed
run counts as finished, so dead runs never hold the server's places. A watchdog thread fails the runs
whose worker makes no progress for --stall-timeout-s, and the API's run, once failed, is replaced by a
fresh one on the next request.

With a run library (library.py), every scenario run that finishes (or fails) saves its whole trace
there, on its own worker thread, as it ends; a saved run opens again as a replay whose every view
is the live run's, after the run has left memory or the server has restarted. Replays of one trace
share one parsed copy (replay_copies.py), counted in bytes against --max-replay-memory-mb before the
trace is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

from kvscope.backend.config import EngineConfig, ModelConfig
from kvscope.backend.errors import ModelLoadError
from kvscope.backend.events.trace import TraceError, parse_trace
from kvscope.backend.model.loader import SHIPPED_MODELS, SHIPPED_MODELS_DIR, SMOLLM2, missing_package, model_facts
from kvscope.backend.model.weights import WeightCache, WeightKey
from kvscope.backend.run import WEIGHTS
from kvscope.backend.scenario import (NAME_PATTERN, SCENARIOS_DIR, Scenario, apply_overrides, check_available,
                              load_scenario, validate)
from kvscope.backend.server.api_run import ApiEngineFlags, ApiRun, api_engine
from kvscope.backend.server.engine_run import EngineRun, ServedScenario
from kvscope.backend.server.grammar_compiles import GrammarCompiles
from kvscope.backend.server.library import LibraryError, Pair, RunLibrary, run_facts
from kvscope.backend.server.memory import give_back_memory_soon
from kvscope.backend.server.limits import (MB, ServiceLimits, WeightMemoryError, WeightNeed, draft_model,
                                           kv_cache_bytes, model_config, weight_needs)
from kvscope.backend.server.replay import ReplayRun
from kvscope.backend.server.replay_copies import ReplayCopies
from kvscope.backend.server.response_store import ResponseStore
from kvscope.backend.server.run_errors import RunBusy, RunError, build_run
from kvscope.backend.server.run_pacing import DEFAULT_SPEED
from kvscope.backend.server.runs import Retention, ServedRun

log = logging.getLogger(__name__)

API_RUN_ID = "api"  # the server's own model; another model named by an API request gets "api-<name>"


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
        config, chat_template = model_facts(name)
        entry.update(description=describe_config(config), chat_template=chat_template)
    except ModelLoadError as e:  # the server's own model, named by a path that no longer loads
        entry.update(installed=False, description=str(e))
    return entry


def estimates(needs: Sequence[WeightNeed]) -> dict[WeightKey, int]:
    """WeightCache's view of needs: key -> estimated bytes (a model that is its own draft counts once)."""
    return {n.key: n.bytes for n in needs}


def describe_copy(need: WeightNeed) -> str:
    quant = f" {need.key.quant}, group {need.key.group_size or 'per-tensor'}" if need.key.quant != "none" else ""
    shards = " (the other tensor-parallel ranks' shards)" if need.key.shards_of else ""
    return f"{need.key.model}{quant}{shards}: {need.bytes / MB:.1f} MB"


class RunManager:
    def __init__(self, default_model: str = "demo", watcher_queue_limit: int | None = None,
                 limits: ServiceLimits | None = None, weights: WeightCache | None = None,
                 library: RunLibrary | None = None, api_flags: ApiEngineFlags = ApiEngineFlags()) -> None:
        self.default_model = default_model
        self.api_flags = api_flags  # `kvscope serve`'s engine flags, which every API run gets
        self.library = library  # finished runs saved to disk; None: none kept (tests, --no-library)
        self.watcher_queue_limit = watcher_queue_limit
        self.limits = limits or ServiceLimits()
        self.runs: dict[str, ServedRun] = {}
        self.kv_bytes: dict[str, int] = {}  # run id -> the KV cache bytes it holds (or is being built with)
        self.weights = weights or WEIGHTS  # the weight copies, held by run id
        self.needs: dict[str, Sequence[WeightNeed]] = {}  # run id -> the weight copies it asked for
        self.replays = ReplayCopies()  # the replays' parsed traces, held by run id
        # a replay opened from the library -> its entry (a compare pair names entries); gone with the replay
        self.opened_from: weakref.WeakKeyDictionary[ServedRun, str] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._api_lock = threading.Lock()  # one API run, however many first requests race to create it
        self._watchdog: threading.Thread | None = None  # started with the first run
        self._closing = threading.Event()
        self._loader: threading.Thread | None = None  # starts the API run for /health (start_api_run_in_background)
        self.load_error: str | None = None  # why that start failed last

        self._api_run_watchers: list[Callable[[str, ApiRun], None]] = []  # GET /metrics (metrics.py)
        # clients' grammars, compiled off the runs' workers: the places are the server's, not a run's
        self.compiles = GrammarCompiles(lambda: self.limits.max_grammar_compiles, lambda: self.limits.grammar_timeout_s)
        # the Responses API's stored conversations (store: true), for previous_response_id
        self.responses = ResponseStore(int(self.limits.stored_responses_mb * MB), self.limits.stored_response_ttl_s)

    def get(self, run_id: str) -> ServedRun | None:
        return self.runs.get(run_id)

    def list(self) -> list[ServedRun]:
        with self._lock:
            return list(self.runs.values())

    def retention(self, open_ended: bool = False, planned: int = 0) -> Retention:
        """What runs keep: windows for the open-ended API run; a scenario keeps its own requests (and up to
        --history live ones besides) and its whole trace; a replay keeps everything it was given."""
        lim = self.limits
        return Retention(history=lim.history if open_ended else lim.history + planned,
                         trace_window=lim.trace_window if open_ended else None, trace_dir=lim.trace_dir,
                         paused_ttl_s=lim.paused_ttl_s, max_waiting=lim.max_waiting, max_viewers=lim.max_viewers,
                         stall_timeout_s=lim.stall_timeout_s, grammar_cache_bytes=int(lim.grammar_cache_mb * MB))

    def start_scenario(self, scenario: str | dict[str, Any], overrides: dict[str, Any] | None = None,
                       speed: float = DEFAULT_SPEED, paused: bool = False, lesson: bool = False) -> ServedRun:
        resolved = self.resolve(scenario, overrides)
        kv = self.kv_bytes_of(resolved.model, resolved.engine)
        needs = self.weight_needs_of(resolved.model, resolved.engine)
        planned = len(resolved.requests) + (resolved.generate.count if resolved.generate else 0)
        retention = self.retention(planned=planned)
        kv_field = "engine.num_blocks" if resolved.engine.num_blocks else "engine.kv_cache_memory_mb"
        return self._add(lambda run_id: self._saved_when_done(
            ServedScenario(resolved, speed, paused, run_id, retention=retention, lesson=lesson, weights=self.weights),
            dict(overrides or {})), kv, kv_field, needs=needs)

    def start_replay(self, events: list[dict], speed: float = DEFAULT_SPEED, paused: bool = False,
                     lesson: bool = False, text: str | None = None) -> ServedRun:
        """A replay of parsed events; `text`, the trace they were parsed from, lets replays of the same text
        share one copy (a client that posts one trace twice)."""
        if text is None:
            key: Hashable = ("trace", uuid.uuid4().hex)
            size = sum(len(json.dumps(e)) + 1 for e in events)
        else:
            digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
            key, size = (f"posted trace {digest[:12]}", digest), len(text)
        return self._start_replay(key, size, lambda: events, speed, paused, lesson)

    def _start_replay(self, key: Hashable, text_bytes: int, events: Callable[[], list[dict]], speed: float,
                      paused: bool, lesson: bool) -> ServedRun:
        """Room for the trace's copy first (or a refusal: nothing read yet), then the copy shared or parsed."""
        retention = replace(self.retention(), history=None)

        def build(run_id: str) -> ReplayRun:
            return ReplayRun(self.replays.copy(key, events), speed, paused, run_id, retention=retention, lesson=lesson)

        return self._add(build, 0, replay=(key, text_bytes))

    # ---- the run library ----------------------------------------------------------------------------

    def saved(self) -> RunLibrary:
        if self.library is None:
            raise LibraryError(None, "this server keeps no run library (started with --no-library)", missing=True)
        return self.library

    def open_saved(self, entry_id: str, speed: float = DEFAULT_SPEED, paused: bool = False,
                   lesson: bool = False) -> ServedRun:
        """A saved run as a replay (a new run id): its trace holds every event, so every view is the live run's.
        Every replay of the entry shares one parsed copy, read from disk by the first."""
        entry = self.saved().get(entry_id)

        def events() -> list[dict]:
            text = self.saved().trace_text(entry_id)
            try:
                return parse_trace(text, f"library entry {entry_id}")
            except TraceError as e:  # a trace edited in place (its size unchanged): a 400 saying where, and a log line
                log.warning("library: cannot open %s: %s", entry_id, e)
                raise

        key = (f"library {entry_id}", entry.created, entry.trace_bytes)  # saved again: another copy
        run = self._start_replay(key, entry.trace_bytes, events, speed, paused, lesson)
        self.opened_from[run] = entry_id
        return run

    def save_pair(self, run_ids: tuple[str, str], name: str | None = None) -> Pair:
        """Two runs of a compare page kept together in the library. A run is named by its id on this server or
        in the library (a saved run's entry has its run's id); a replay opened from the library stands for its
        entry."""
        return self.saved().save_pair((self._entry_id(run_ids[0]), self._entry_id(run_ids[1])), name)

    def _entry_id(self, run_id: str) -> str:
        run = self.get(run_id)
        return self.opened_from.get(run, run_id) if run is not None else run_id

    def open_pair(self, pair_id: str, speed: float = DEFAULT_SPEED, paused: bool = False,
                  lesson: bool = False) -> tuple[ServedRun, ServedRun]:
        """Both runs of a saved pair as replays; if the second cannot open (the replays' memory), the first is
        closed again."""
        first, second = self.saved().get_pair(pair_id).runs
        left = self.open_saved(first, speed, paused, lesson)
        try:
            return left, self.open_saved(second, speed, paused, lesson)
        except Exception:
            self.close(left.run_id)
            raise

    def _saved_when_done(self, run: ServedScenario, overrides: dict[str, Any]) -> ServedScenario:
        """Subscribed before the run starts, so that even an unpaced run's end is seen."""
        if self.library is not None:
            run.bus.subscribe(lambda event: self._save_if_done(run, event, overrides))
        return run

    def _save_if_done(self, run: ServedScenario, event: dict, overrides: dict[str, Any]) -> None:
        """On the run's thread, after the run applied `event`: its end (finished, or failed) saves it."""
        if event["type"] != "run_finished" and not (event["type"] == "error" and event.get("fatal")):
            return
        state = run.state
        facts = run_facts(run.run_id, state.scenario, state.model, overrides, run.pacing.lesson, state.step,
                          len(state.requests), run.failure)
        try:
            self.library.save(run.trace_jsonl(), **facts)
        except (OSError, ValueError) as e:  # a full disk or a bad fact: the run is over either way, never failed by it
            log.error("library: run %s not saved: %s", run.run_id, e)

    def close(self, run_id: str) -> bool:
        """Stop and forget a run now, letting go of what it holds (False: no such run). The API's runs serve
        every /v1 request and restart on the next one, so they are not closed: RunError."""
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                return False
            if isinstance(run, ApiRun):
                raise RunError("run_id", f"run {run_id!r} is the API's: it serves every /v1 request for its model "
                                         "and is never closed")
            self._forget_locked(run_id)
        return True

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

    def api_run(self, model: str | None = None) -> ApiRun:
        """The open-ended run that OpenAI-compatible requests for `model` join (created on first use)."""
        model = model or self.default_model
        run_id = API_RUN_ID if model == self.default_model else f"{API_RUN_ID}-{model}"
        with self._api_lock:
            with self._lock:
                run = self.runs.get(run_id)
                if run is not None and run.failure is not None:  # the service restarts itself
                    self._forget_locked(run_id)
                    run = None
            return run if run is not None else self._start_api_run(model, run_id)

    def api_state(self) -> str:
        """"serving" when the server's own model's API run is up, "failed" when it failed or its last start
        did (load_error says why), else "loading"."""
        run = self.runs.get(API_RUN_ID)
        if run is not None and run.failure is None:
            return "serving"
        return "failed" if run is not None or self.load_error is not None else "loading"

    def start_api_run_in_background(self) -> None:
        """Start the server's own model's API run on a thread of its own, unless it serves or a start is under
        way: `kvscope serve` calls it as it starts, and /health while the run does not serve, so that the
        probe turns to serving without any request (and a failed run is replaced)."""
        if self.api_state() == "serving":
            return
        with self._lock:
            if self._loader is None or not self._loader.is_alive():
                self._loader = threading.Thread(target=self._load_api_run, name="api-run-loader", daemon=True)
                self._loader.start()

    def _load_api_run(self) -> None:
        try:
            self.api_run()
            self.load_error = None
        except Exception as e:  # the model cannot load, or the limits refuse it: /health says so
            self.load_error = f"{type(e).__name__}: {e}"
            log.warning("the API run could not start: %s", self.load_error)

    def watch_api_runs(self, watcher: Callable[[str, ApiRun], None]) -> None:
        """Call watcher(model, run) for each API run, held now or started later (before it takes a request)."""
        with self._api_lock:
            self._api_run_watchers.append(watcher)
            held = [r for r in self.runs.values() if isinstance(r, ApiRun)]
        for run in held:
            watcher(run.model, run)

    def api_config(self, model: str) -> EngineConfig:
        """The engine settings of `model`'s API run (/v1/models reports its max_model_len before it loads)."""
        return api_engine(model, self.limits.api_events, self.api_flags)

    def _start_api_run(self, model: str, run_id: str) -> ApiRun:
        config = self.api_config(model)
        run = self._add(lambda _: ApiRun(model, config, run_id, self.retention(open_ended=True), self.weights),
                        self.kv_bytes_of(model, config), "engine.num_blocks", run_id=run_id,
                        needs=self.weight_needs_of(model, config))
        assert isinstance(run, ApiRun)
        for watch in self._api_run_watchers:  # under _api_lock: no request reaches the run before they see it
            watch(model, run)
        return run

    # ---- what a client may name -------------------------------------------------------------------

    def resolve(self, scenario: str | dict[str, Any], overrides: dict[str, Any] | None) -> Scenario:
        """A scenario name or inline object, with dotted overrides applied, validated, its models allowed."""
        if isinstance(scenario, str):
            base = self._named_scenario(scenario).model_dump(mode="json")
            source = f"scenario {scenario}"
        else:
            base, source = dict(scenario), "scenario"
        items = [(key, value, f"overrides {key}={json.dumps(value)}") for key, value in (overrides or {}).items()]
        resolved = validate(base, source, apply_overrides(base, items))
        self._check_models(resolved)
        ranks, most = resolved.engine.tensor_parallel, max(self.limits.max_tensor_parallel, self.api_flags.tensor_parallel)
        if ranks > most:  # checked before any process is started
            raise RunError("engine.tensor_parallel", f"{ranks} ranks; this server starts at most {most} for a run "
                                                     "(--max-tensor-parallel)")
        check_available(resolved)  # before kv_bytes_of loads the model: the install command, not a load error
        return resolved

    def _named_scenario(self, name: str) -> Scenario:
        """A bundled scenario by name; a path only with --allow-paths (the answer never tells what exists)."""
        if self.limits.allow_paths:
            return load_scenario(name)
        if not re.match(NAME_PATTERN, name) or not (SCENARIOS_DIR / f"{name}.yaml").is_file():
            raise RunError("scenario", f"{name!r} is not a bundled scenario (GET /api/scenarios lists them); send "
                                       "any other scenario inline (an object, or YAML text in `yaml`)")
        return load_scenario(name)

    def _check_models(self, scenario: Scenario) -> None:
        if self.limits.allow_paths:
            return
        allowed = (*self.limits.model_names(), self.default_model)
        spec = scenario.engine.speculative
        named = [("model", scenario.model)]
        if spec is not None and spec.method == "draft":
            named.append(("engine.speculative.draft_model", spec.draft_model))
        offered = ", ".join(dict.fromkeys(allowed))
        for field, name in named:
            if name not in allowed:
                raise RunError(field, f"{name!r} is not a model this server offers ({offered}); "
                                      "model folders need a server started with --allow-paths")

    # ---- limits -------------------------------------------------------------------------------------

    def kv_bytes_of(self, model: str, engine: EngineConfig) -> int:
        """The KV bytes the run's engine would allocate (from the models' configs: nothing is loaded)."""
        draft = draft_model(engine)
        return build_run(lambda: kv_cache_bytes(engine, model_config(model), model_config(draft) if draft else None))

    def weight_needs_of(self, model: str, engine: EngineConfig) -> list[WeightNeed]:
        """The weight copies the run would hold, sized from the configs (nothing is loaded)."""
        return build_run(lambda: weight_needs(model, engine))

    def usage(self) -> dict:
        """What the limits count now and allow (GET /api/limits): runs, KV caches, weight copies, grammars."""
        with self._lock:
            runs, kv = len(self.kv_bytes), self._kv_held()
            engines = [r for r in self.runs.values() if isinstance(r, EngineRun)]
        lim = self.limits
        caches = [{"run_id": r.run_id, "bytes": r.grammars.cached_bytes, "max_bytes": r.grammars.max_bytes,
                   "grammars": r.grammars.num_cached} for r in engines]
        return {"runs": runs, "max_runs": lim.max_runs, "kv_bytes": kv, "max_kv_bytes": int(lim.max_kv_memory_mb * MB),
                "weight_bytes": self.weights.held_bytes(), "max_weight_bytes": int(lim.max_weight_memory_mb * MB),
                "weight_copies": self.weights.describe(), "rank_processes": self._rank_processes(),
                "replay_bytes": self.replays.held_bytes(), "max_replay_bytes": int(lim.max_replay_memory_mb * MB),
                "replay_copies": self.replays.describe(),
                "grammar_bytes": sum(c["bytes"] for c in caches),
                "max_grammar_bytes_per_run": int(lim.grammar_cache_mb * MB),
                "grammar_caches": caches, "grammar_compiles": self.compiles.in_flight,
                "max_grammar_compiles": lim.max_grammar_compiles, "grammar_timeout_s": lim.grammar_timeout_s,
                **self.responses.describe()}

    def _rank_processes(self) -> list[dict]:
        """Each tensor-parallel run's other ranks: processes of their own, their weight shards' bytes (counted
        in weight_bytes) and their share of the run's KV pools (counted in kv_bytes)."""
        with self._lock:
            held = [(rid, r) for rid, r in self.runs.items() if isinstance(r, EngineRun)]
            out = []
            for rid, run in held:
                ranks = run.engine.config.tensor_parallel
                if ranks > 1:
                    shards = sum(n.bytes for n in self.needs.get(rid, ()) if n.key.shards_of)
                    out.append({"run_id": rid, "processes": ranks - 1, "weight_bytes": shards,
                                "kv_bytes": self.kv_bytes.get(rid, 0) * (ranks - 1) // ranks})
            return out

    def _add(self, build: Callable[[str], ServedRun], kv: int, kv_field: str = "engine.num_blocks",
             run_id: str | None = None, needs: Sequence[WeightNeed] = (),
             replay: tuple[Hashable, int] | None = None) -> ServedRun:
        """Reserve room (or refuse, naming kv_field, the weight copy's field or the replays' limit), build the run
        outside the lock, then start it. `replay`: the key and text bytes of the trace a replay holds."""
        run_id = run_id or uuid.uuid4().hex[:12]
        with self._lock:
            self._make_room_locked(kv, kv_field, needs, replay)
            self.kv_bytes[run_id] = kv
            self.needs[run_id] = needs
            self.weights.hold(run_id, estimates(needs))
            if replay is not None:
                self.replays.hold(run_id, *replay)
        try:
            run = build_run(lambda: build(run_id))
        except BaseException:
            with self._lock:
                self.kv_bytes.pop(run_id, None)
                self.needs.pop(run_id, None)
                self.weights.release(run_id)
                self.replays.release(run_id)
            raise
        if self.watcher_queue_limit:
            run.viewers.queue_limit = self.watcher_queue_limit
        run.on_expired = self._expired
        with self._lock:
            self.runs[run_id] = run
            self._start_watchdog_locked()
        return run.start()

    def _make_room_locked(self, kv: int, kv_field: str, needs: Sequence[WeightNeed] = (),
                          replay: tuple[Hashable, int] | None = None) -> None:
        lim = self.limits
        if kv > lim.run_kv_ceiling_mb * MB:
            raise RunError(kv_field, f"this run's KV cache would take {kv / MB:.1f} MB; the server allows "
                                     f"{lim.run_kv_ceiling_mb:g} MB per run (--max-run-kv-memory-mb)")
        # Failed runs are finished too (the API's runs finish no other way): dead runs never hold a place.
        finished = [rid for rid, r in self.runs.items() if r.finished]
        while finished and (len(self.kv_bytes) >= lim.max_runs or self._kv_held() + kv > lim.max_kv_memory_mb * MB
                            or self._weights_over_locked(needs) or self._replays_over(replay)):
            self._forget_locked(finished.pop(0))
        if self._replays_over(replay):
            self._refuse_replay(*replay)
        if len(self.kv_bytes) >= lim.max_runs:
            raise RunError(None, f"too many runs at once (at most {lim.max_runs}, --max-runs); let one finish first")
        if self._kv_held() + kv > lim.max_kv_memory_mb * MB:
            raise RunError(kv_field, f"this run's KV cache would take {kv / MB:.1f} MB, and the runs held now "
                                     f"take {self._kv_held() / MB:.1f} of the server's {lim.max_kv_memory_mb:g} MB "
                                     "(--max-kv-memory-mb); let a run finish first")
        if self._weights_over_locked(needs):
            self._refuse_weights_locked(needs)

    def _replays_over(self, replay: tuple[Hashable, int] | None) -> bool:
        """Would one more replay of this trace pass --max-replay-memory-mb? (A copy held already adds only
        the replay's own reducer.)"""
        return replay is not None and \
            self.replays.held_bytes() + self.replays.new_bytes(*replay) > self.limits.max_replay_memory_mb * MB

    def _refuse_replay(self, key: Hashable, text_bytes: int) -> None:
        """A 429 while replays hold the room (one may end or expire), a 400 for a trace that never fits."""
        need, held = self.replays.new_bytes(key, text_bytes), self.replays.held_bytes()
        limit = self.limits.max_replay_memory_mb
        what = (f"replaying this trace ({text_bytes / MB:.1f} MB of JSON) needs {need / MB:.1f} MB parsed, "
                f"and the server keeps its replays within {limit:g} MB (--max-replay-memory-mb)")
        if need > limit * MB:
            raise RunError("trace", what)
        raise RunBusy(f"{what}; the replays held now take {held / MB:.1f} MB. Replays of one trace share one copy: "
                      "let a replay end or expire, then try again")

    def _kv_held(self) -> int:
        return sum(self.kv_bytes.values())

    def _weights_over_locked(self, needs: Sequence[WeightNeed]) -> bool:
        """Would the new copies among `needs` pass --max-weight-memory-mb? (Shared ones add nothing.)"""
        new = self.weights.new_bytes(estimates(needs))
        return new > 0 and self.weights.held_bytes() + new > self.limits.max_weight_memory_mb * MB

    def _refuse_weights_locked(self, needs: Sequence[WeightNeed]) -> None:
        new = [n for n in needs if self.weights.new_bytes({n.key: n.bytes})]
        copies = " and ".join(describe_copy(n) for n in new)
        room = self.limits.max_weight_memory_mb * MB - self.weights.held_bytes()
        over = next(n for i, n in enumerate(new) if sum(m.bytes for m in new[:i + 1]) > room)  # the one that does not fit
        raise WeightMemoryError(over.field, f"this run needs a new weight copy ({copies}), and the copies "
                                              f"held now take {self.weights.held_bytes() / MB:.1f} of the server's "
                                              f"{self.limits.max_weight_memory_mb:g} MB (--max-weight-memory-mb); "
                                              "use a model and settings a run already uses, or let a run finish")

    def _expired(self, run_id: str) -> None:
        """A run's worker ended after the run expired (on that thread, no lock held): forget it."""
        with self._lock:
            if self.runs.get(run_id) is not None and self.runs[run_id].expired:
                self._forget_locked(run_id)

    def _forget_locked(self, run_id: str) -> None:
        self.kv_bytes.pop(run_id, None)
        self.needs.pop(run_id, None)
        self.weights.release(run_id)
        self.replays.release(run_id)
        run = self.runs.pop(run_id, None)
        if run is not None:
            run.stop()  # a worker still running gives its run's memory back as it ends (run_worker.py) ...
            give_back_memory_soon()  # ... one that had ended (an expired run) left it to the manager's reference

    # ---- supervision ----------------------------------------------------------------------------

    def _start_watchdog_locked(self) -> None:
        if self._watchdog is None and self.limits.stall_timeout_s is not None:
            self._watchdog = threading.Thread(target=self._watch, name="run-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        """Fail every run whose worker is past its deadline: a step or a command that never returns."""
        stall = self.limits.stall_timeout_s
        while not self._closing.wait(min(1.0, stall / 4)):
            with self._lock:
                runs = list(self.runs.values())
            now = time.monotonic()
            for run in runs:
                if run.stalled(now):
                    run.fail(f"no progress for {stall:g} s (--stall-timeout-s)")

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Every engine run ends its unfinished requests (finish_reason abort); does not wait."""
        for run in list(self.runs.values()):
            run.abort_in_flight(reason)

    def stop_all(self) -> None:
        self._closing.set()
        for run_id, run in list(self.runs.items()):
            run.stop()
            self.weights.release(run_id)  # the process's cache outlives this manager (tests make several)
            self.replays.release(run_id)
