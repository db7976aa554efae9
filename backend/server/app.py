"""The Litestar application: REST routes for scenarios and runs, the websocket, the OpenAI API.

Every user error is a 4xx with a JSON body `{"error": ..., "field": ...}`; nothing a client sends
may produce a 5xx. Routes that start, control or add to runs need the bearer token when one is set
(non-loopback binds); watching stays open on loopback. guards.py checks every connection first
(JSON bodies, Host, Origin, watching off loopback).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from litestar import Litestar, MediaType, Request, Response, delete, get, patch, post
from litestar.config.cors import CORSConfig
from litestar.params import FromPath, JSONBody, Parameter
from litestar.exceptions import HTTPException, NotFoundException, ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.response import File
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvscope.backend.engine.admission import parse_sampling
from kvscope.backend.engine.dist_rows import row_text
from kvscope.backend.errors import KvscopeError, pydantic_reason
from kvscope.backend.events.trace import parse_trace
from kvscope.backend.model.chat import encode_chat
from kvscope.backend.scenario import (ChatMessage, YAMLTooDeep, bundled_path, list_scenarios, load_scenario,
                                     safe_load)
from kvscope.backend.server.engine_run import EngineRun
from kvscope.backend.server.grammar_compiles import ClientGone
from kvscope.backend.server.guards import require_token
from kvscope.backend.server.library import MAX_NAME, LibraryError
from kvscope.backend.server.limits import ServiceLimits
from kvscope.backend.server.manager import RunManager
from kvscope.backend.server.openai_serving import client_gone
from kvscope.backend.server.run_errors import RunBusy, RunClosed, RunError
from kvscope.backend.server.runs import ServedRun

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)
PROMETHEUS_TEXT = "text/plain; version=0.0.4"  # the text format Prometheus scrapes


# ---- bodies -----------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Iterations per second. Below the floor the worker's wait for its next iteration overflowed the timer
# (speed 1e-300 killed the run's thread); one iteration in 100 s is slower than anyone watches.
MIN_SPEED, MAX_SPEED = 0.01, 10_000.0


def _paced(speed: float) -> float:
    if 0 < speed < MIN_SPEED:
        raise ValueError(f"speed is 0 (unpaced) or {MIN_SPEED:g}..{MAX_SPEED:g} iterations per second")
    return speed


Speed = Annotated[float, Field(ge=0, le=MAX_SPEED, description="iterations per second; 0 = unpaced"),
                  AfterValidator(_paced)]


class StartRun(_Body):
    scenario: str | dict[str, Any] | None = Field(default=None, description="a bundled scenario's name or an "
                                                                           "inline scenario")
    yaml: str | None = Field(default=None, max_length=100_000, description="an inline scenario as YAML text")
    overrides: dict[Annotated[str, Field(max_length=128)], Any] = \
        Field(default_factory=dict, max_length=64, description="dotted paths, e.g. engine.block_size")
    trace: str | None = Field(default=None, description="JSONL text of a recorded trace to replay (bounded by "
                                                        "the body size limit)")
    speed: Speed = 4.0
    paused: bool = False
    lesson: bool = Field(default=False, description="lesson mode: pause after each iteration in which a moment "
                                                    "the scenario's lesson explains happened")

    @field_validator("scenario")
    @classmethod
    def _bounded(cls, scenario: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if scenario is not None and len(scenario) > 128:
            raise ValueError("a name has at most 128 characters, an inline scenario at most 128 fields")
        return scenario


class Control(_Body):
    action: Literal["pause", "resume", "step", "speed", "seek", "lesson"]
    value: float | None = Field(default=None, ge=0, le=1_000_000)

    @field_validator("value")
    @classmethod
    def _fits_action(cls, value: float | None, info: ValidationInfo) -> float | None:
        """speed within Speed's range; step (a count) and seek (a step number) whole numbers."""
        action = info.data.get("action")
        if value is not None and action == "speed":
            if value > MAX_SPEED:
                raise ValueError(f"speed is at most {MAX_SPEED:g} iterations per second")
            return _paced(value)
        if value is not None and action in ("step", "seek") and value != int(value):
            raise ValueError(f"{action} takes a whole number, not {value:g}")
        return value


class AddRequest(_Body):
    prompt: str | None = Field(default=None, min_length=1, max_length=100_000)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=64,
                                               description="a chat, written with the run's model's chat template")
    chat: bool = Field(default=False, description="the prompt is one user message of a chat")
    max_tokens: int = Field(default=32, ge=1, le=100_000)
    sampling: dict[Annotated[str, Field(max_length=64)], Any] = Field(default_factory=dict, max_length=32)


class OpenSaved(_Body):
    speed: Speed = 4.0
    paused: bool = True  # a prepared run opens at its start, for the class to watch from step 0
    lesson: bool = False


class RenameSaved(_Body):
    name: str = Field(min_length=1, max_length=MAX_NAME)


RunId = Annotated[str, Field(min_length=1, max_length=64)]


class SavePair(_Body):
    runs: tuple[RunId, RunId] = Field(description="the compare page's two runs, left then right: ids on this "
                                                  "server (a replay of a saved run stands for it) or in the library")
    name: str | None = Field(default=None, min_length=1, max_length=MAX_NAME,
                             description="default: the scenario and the settings that differ")


# ---- guards and errors --------------------------------------------------------------------------------


def _error(status: int, message: str, field: str | None = None) -> Response:
    return Response({"error": message, "field": field}, status_code=status, media_type=MediaType.JSON)


def user_error(_: Request, exc: KvscopeError) -> Response:
    return _error(400, str(exc), exc.field)


def library_error(_: Request, exc: LibraryError) -> Response:
    return _error(404 if exc.missing else 400, str(exc), exc.field)


def closed_error(_: Request, exc: RunClosed) -> Response:
    return Response({"error": str(exc), "field": None, "state": exc.state}, status_code=409, media_type=MediaType.JSON)


def client_left(_: Request, exc: ClientGone) -> Response:
    return _error(499, "the client went away")  # nobody reads it: nginx's "client closed request"


def busy_error(_: Request, exc: RunBusy) -> Response:
    response = _error(429, str(exc))
    response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


def http_error(_: Request, exc: HTTPException) -> Response:
    extra = exc.extra if isinstance(exc, ValidationException) else None
    field = None
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        field = extra[0].get("key")
        reason = pydantic_reason(str(extra[0].get("message")))
        message = f"{field}: {reason}" if field else reason
    else:
        message = exc.detail
    return _error(exc.status_code, message, field)


def run_or_404(request: Request, run_id: str) -> ServedRun:
    run = request.app.state.manager.get(run_id)
    if run is None:
        raise NotFoundException(f"no run {run_id!r}")
    return run


# ---- routes ---------------------------------------------------------------------------------------------


@get("/api/health")
async def health() -> dict:
    return {"status": "ok"}


@get("/api/limits")
async def limits_held(request: Request) -> dict:
    """What the limits count now and what they allow: runs, KV cache bytes, weight copies and their bytes."""
    return request.app.state.manager.usage()


@get("/api/scenarios", sync_to_thread=True)
def scenarios() -> list[dict]:
    """Each bundled scenario; one whose model is not installed is `available: false`, `unavailable` says how to install it."""
    listed = []
    for s in list_scenarios():
        reason = s.unavailable()
        listed.append({"name": s.name, "description": s.description, "lesson": [step.model_dump() for step in s.lesson], "model": s.model,
                       "available": reason is None, "unavailable": reason})
    return listed


@get("/api/models", sync_to_thread=True)  # looks for packages and model folders on disk
def models(request: Request) -> list[dict]:
    """Models to start runs with: installed or the install command, a one-line description, chat template or not."""
    return request.app.state.manager.models()


@get("/api/scenarios/{name:str}", sync_to_thread=True)
def scenario(name: FromPath[str]) -> dict:
    if bundled_path(name) is None:  # the name pattern keeps lookups inside scenarios/ (no dots, no slashes)
        raise NotFoundException(f"no scenario {name[:64]!r}")
    return load_scenario(name).model_dump(mode="json")


@get("/api/runs")
async def list_runs(request: Request) -> list[dict]:
    return [run.describe() for run in request.app.state.manager.list()]


@post("/api/runs", guards=[require_token], sync_to_thread=True, status_code=201)
def start_run(request: Request, data: JSONBody[StartRun]) -> dict:
    try:
        run = _start(request.app.state.manager, data)
    except KvscopeError as e:  # a 400 for the client, and a line in the server's log for whoever runs it
        log.warning("POST /api/runs refused: %s", e, exc_info=e.__cause__)
        raise
    return {"run_id": run.run_id, "kind": run.kind}


def _start(manager: RunManager, data: StartRun) -> ServedRun:
    if data.trace is not None:
        return manager.start_replay(parse_trace(data.trace, "trace"), data.speed, data.paused, data.lesson, data.trace)
    if data.yaml is not None:
        return manager.start_scenario(inline_yaml(data.yaml), data.overrides, data.speed, data.paused, data.lesson)
    if data.scenario is not None:
        return manager.start_scenario(data.scenario, data.overrides, data.speed, data.paused, data.lesson)
    raise RunError("scenario", "give a scenario (name or object), yaml or a trace")


def inline_yaml(text: str) -> dict[str, Any]:
    """A scenario sent as YAML text; a syntax error names its line and column, nothing else."""
    try:
        data = safe_load(text)
    except YAMLTooDeep as e:
        raise RunError("yaml", f"{e.problem} at line {e.problem_mark.line + 1}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RunError("yaml", f"not valid YAML{where}") from None
    except yaml.YAMLError:
        raise RunError("yaml", "not valid YAML") from None
    if not isinstance(data, dict):
        raise RunError("yaml", "a scenario is a mapping (name:, engine:, requests: ...)")
    return data


@get("/api/runs/{run_id:str}", sync_to_thread=True)
def run_snapshot(request: Request, run_id: FromPath[str]) -> dict:
    return run_or_404(request, run_id).snapshot()


@delete("/api/runs/{run_id:str}", guards=[require_token], sync_to_thread=True, status_code=204)
def close_run(request: Request, run_id: FromPath[str]) -> None:
    """Stop and forget a run now: its KV cache, weight copies, replayed trace and a tensor-parallel engine's
    ranks are let go (the API's runs are never closed)."""
    if not request.app.state.manager.close(run_id):
        raise NotFoundException(f"no run {run_id!r}")


@post("/api/runs/{run_id:str}/control", guards=[require_token], sync_to_thread=True, status_code=200)
def control(request: Request, run_id: FromPath[str], data: JSONBody[Control]) -> dict:
    run = run_or_404(request, run_id)
    run.control(data.action, data.value)
    return run.describe()


@post("/api/runs/{run_id:str}/requests", guards=[require_token], status_code=201)
async def add_request(request: Request, run_id: FromPath[str], data: JSONBody[AddRequest]) -> dict:
    run = run_or_404(request, run_id)
    if not isinstance(run, EngineRun):
        raise RunError("run_id", "a replay cannot take new requests")
    prompt = await asyncio.to_thread(prompt_of, data, run)  # a chat renders in a process of its own
    compiled = await live_grammar(request, run, data.sampling)
    rid = await asyncio.to_thread(run.add_request, prompt, data.max_tokens, data.sampling, None, None, compiled)
    return {"request_id": rid}


async def live_grammar(request: Request, run: EngineRun, sampling: dict[str, Any]) -> CompiledGrammar | None:
    """A live request's grammar compiled off the run's worker, as the OpenAI routes compile theirs
    (grammar_compiles.py); a refusal names `sampling.structured_outputs.<kind>`."""
    spec = parse_sampling(sampling).structured_outputs
    if spec is None:
        return None
    return await request.app.state.manager.compiles.compiled(run.grammars, spec, f"sampling.structured_outputs."
                                                             f"{spec.kind}", lambda: client_gone(request))


def prompt_of(data: AddRequest, run: EngineRun) -> str | list[int]:
    """The request's prompt: as given, or its chat written with the run's model's chat template (token ids)."""
    if (data.prompt is None) == (data.messages is None):
        raise RunError("prompt", "give exactly one of prompt and messages")
    if data.messages is not None and data.chat:
        raise RunError("chat", "goes with a prompt (messages are a chat already)")
    if data.messages is not None:
        return encode_chat([m.model_dump() for m in data.messages], run.loaded)
    return encode_chat([{"role": "user", "content": data.prompt}], run.loaded) if data.chat else data.prompt


@get("/api/runs/{run_id:str}/trace", media_type="application/x-ndjson", sync_to_thread=True)
def run_trace(request: Request, run_id: FromPath[str]) -> str | File | Response:
    """The whole trace when the server writes trace files (--trace-dir), else what the run keeps."""
    run = run_or_404(request, run_id)
    path = run.flush_trace()
    if path is not None:
        return File(path, media_type="application/x-ndjson", content_disposition_type="inline")
    if run.trace_fault is not None:  # the whole trace is lost: the window would pass for it, so say so
        return _error(503, f"this run's trace file stopped ({run.trace_fault}), so its whole trace is not "
                           "available; the run went on without it")
    return run.trace_jsonl()


MAX_ID_LENGTH = 256  # request ids are at most this long (the scenario's and the API's)
SeqOrPosition = Annotated[int, Parameter(ge=0, lt=2**31)]


@get("/api/runs/{run_id:str}/dist", sync_to_thread=False)
def token_dist(request: Request, run_id: FromPath[str],
               request_id: Annotated[str, Parameter(min_length=1, max_length=MAX_ID_LENGTH)],
               seq_id: SeqOrPosition, position: SeqOrPosition) -> dict:
    """The whole raw (T = 1) distribution of one token event, while the run still keeps it (dist_rows.py)."""
    run = run_or_404(request, run_id)
    row = run.dist_rows.get(request_id, seq_id, position) if run.dist_rows is not None else None
    if row is None:
        raise NotFoundException(f"run {run_id!r} keeps no distribution for request {request_id!r} seq {seq_id} "
                                f"position {position} (a replay, an evicted row, or no such token)")
    return {"request_id": request_id, "seq_id": seq_id, "position": position, "vocab_size": len(row) // 4,
            "raw_probs_f32": row_text(row)}


@get("/metrics", sync_to_thread=True)  # reads each API run's reducer under its lock
def prometheus_metrics(request: Request) -> Response:
    """The API runs' numbers in Prometheus' text format, under vLLM's names (metrics.py, docs/api.md)."""
    return Response(request.app.state.metrics.exposition(), media_type=PROMETHEUS_TEXT)


# ---- the run library (library.py) -----------------------------------------------------------------------


@get("/api/library", sync_to_thread=True)
def library_list(request: Request) -> dict:
    """The saved runs, newest first, and the folder's bytes against its limit (--library-max-mb)."""
    library = request.app.state.manager.library
    if library is None:
        return {"enabled": False, "bytes": 0, "max_bytes": 0, "entries": [], "pairs": []}
    entries = library.entries()
    return {"enabled": True, "bytes": sum(e.trace_bytes for e in entries), "max_bytes": library.max_bytes,
            "entries": [e.model_dump() for e in entries], "pairs": [p.model_dump() for p in library.pairs()]}


# Not on a thread: with three sync handlers on one path, Litestar 2.25 answered this GET with its
# handler's coroutine unawaited (a 500); reading a sidecar (64 KB at most) is quick.
@get("/api/library/{entry_id:str}")
async def library_entry(request: Request, entry_id: FromPath[str]) -> dict:
    return request.app.state.manager.saved().get(entry_id).model_dump()


@patch("/api/library/{entry_id:str}", guards=[require_token], sync_to_thread=True)
def library_rename(request: Request, entry_id: FromPath[str], data: JSONBody[RenameSaved]) -> dict:
    return request.app.state.manager.saved().rename(entry_id, data.name).model_dump()


@delete("/api/library/{entry_id:str}", guards=[require_token], sync_to_thread=True, status_code=204)
def library_delete(request: Request, entry_id: FromPath[str]) -> None:
    request.app.state.manager.saved().delete(entry_id)


@post("/api/library/{entry_id:str}/open", guards=[require_token], sync_to_thread=True, status_code=201)
def library_open(request: Request, entry_id: FromPath[str], data: JSONBody[OpenSaved]) -> dict:
    run = request.app.state.manager.open_saved(entry_id, data.speed, data.paused, data.lesson)
    return {"run_id": run.run_id, "kind": run.kind}


@post("/api/library/pairs", guards=[require_token], sync_to_thread=True, status_code=201)
def library_save_pair(request: Request, data: JSONBody[SavePair]) -> dict:
    """A compare page's two runs, kept in the library as one pair (both must be saved runs: finished)."""
    return request.app.state.manager.save_pair(data.runs, data.name).model_dump()


@delete("/api/library/pairs/{pair_id:str}", guards=[require_token], sync_to_thread=True, status_code=204)
def library_delete_pair(request: Request, pair_id: FromPath[str]) -> None:
    request.app.state.manager.saved().delete_pair(pair_id)


@post("/api/library/pairs/{pair_id:str}/open", guards=[require_token], sync_to_thread=True, status_code=201)
def library_open_pair(request: Request, pair_id: FromPath[str], data: JSONBody[OpenSaved]) -> dict:
    """Both runs as replays, for the compare page `/?run=A&compare=B`."""
    runs = request.app.state.manager.open_pair(pair_id, data.speed, data.paused, data.lesson)
    return {"run_ids": [run.run_id for run in runs]}


# ---- the application ------------------------------------------------------------------------------------


def create_app(manager: RunManager | None = None, token: str | None = None, max_body_bytes: int = 2_000_000,
               cors_origins: list[str] | None = None, host: str = "127.0.0.1", public_watch: bool = False,
               dashboard_origin: str | None = None, limits: ServiceLimits | None = None) -> Litestar:
    """The whole service. `token`: required on changing routes (set it for non-loopback binds).

    `limits`: KV memory, runs, queues, viewers, timeouts and paths (limits.py); they replace the manager's.

    `host`: the bind address (on loopback the Host header must be a loopback name); `public_watch`:
    off loopback, watching runs needs no token; `dashboard_origin`: a browser origin trusted like a
    --cors-origin (guards.py)."""
    from kvscope.backend.server.guards import CONNECTION_GUARDS
    from kvscope.backend.server.metrics import ServerMetrics
    from kvscope.backend.server.openai_api import openai_routes
    from kvscope.backend.server.openai_errors import openai_errors_under_v1
    from kvscope.backend.server.probes import probe_routes
    from kvscope.backend.server.responses_api import responses_routes
    from kvscope.backend.server.serve import is_loopback
    from kvscope.backend.server.ws import SendBudget, run_socket

    manager = manager or RunManager(limits=limits)
    if limits is not None:
        manager.limits = limits
    app = Litestar(
        route_handlers=[health, limits_held, scenarios, models, scenario, list_runs, start_run, run_snapshot,
                        close_run, control, add_request, run_trace, token_dist, library_list, library_entry,
                        library_rename, library_delete, library_open, library_save_pair, library_delete_pair,
                        library_open_pair, prometheus_metrics, run_socket, *openai_routes,
                        *responses_routes, *probe_routes],
        exception_handlers={KvscopeError: user_error, RunClosed: closed_error, LibraryError: library_error,
                            RunBusy: busy_error, ClientGone: client_left,
                            HTTPException: openai_errors_under_v1(http_error)},
        guards=CONNECTION_GUARDS,
        openapi_config=OpenAPIConfig(title="kvscope", version="0.1.0", path="/schema"),
        cors_config=CORSConfig(allow_origins=cors_origins) if cors_origins else None,
        request_max_body_size=max_body_bytes,
        on_shutdown=[manager.stop_all],
        debug=False,
    )
    app.state.manager = manager
    app.state.metrics = ServerMetrics(manager)
    app.state.viewer_budget = SendBudget(manager.limits.viewer_events_per_s)
    app.state.token = token
    app.state.loopback = is_loopback(host)
    app.state.public_watch = public_watch
    app.state.trusted_origins = {o.rstrip("/").lower() for o in [*(cors_origins or []), dashboard_origin] if o}
    return app


def new_token() -> str:
    return secrets.token_urlsafe(24)
