"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Close enough to OpenAI's wire format that the official `openai` client works unchanged. Every
request joins the server's open-ended run "api", so the dashboard can watch it being scheduled,
paged and sampled. The engine lives on that run's worker thread and reports through events; a
request's listener (called on the worker thread) hands them to the request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from litestar import MediaType, Request, Response, Router, get, post
from litestar.exceptions import HTTPException, ValidationException
from litestar.params import JSONBody
from litestar.response import ServerSentEvent
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backend.engine.request import RequestError
from backend.engine.sampling_params import SamplingParams
from backend.model.loader import ModelLoadError
from backend.server.app import require_token  # off-loopback, the server token is the client's api_key
from backend.server.chat_template import ChatTemplateError, render_chat
from backend.server.generation import Choice, Generation
from backend.server.runs import EngineRun

DEFAULT_CHAT_MAX_TOKENS = 256  # OpenAI's is "the rest of the context"; the demo models stop long before


# ---- bodies (extra fields allowed: OpenAI clients send many we do not use) ----------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=100_000)
    temperature: float | None = None  # bounds: SamplingParams, the engine's one definition of them
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None  # vLLM's extras, handy to watch a long generation
    stop_token_ids: list[int] | None = None
    n: int | None = Field(default=None, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=100_000)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# ---- errors in OpenAI's shape ---------------------------------------------------------------------------


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type


def _error_response(e: OpenAIError) -> Response:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return Response(body, status_code=e.status, media_type=MediaType.JSON)


def _to_openai_error(_: Request, exc: Exception) -> Response:
    """One edge for every failure of these routes: user errors are 4xx, never 5xx."""
    if isinstance(exc, OpenAIError):
        return _error_response(exc)
    if isinstance(exc, RequestError):  # the engine's field names are "sampling.x" where OpenAI's are "x"
        return _error_response(OpenAIError(400, str(exc), exc.field.removeprefix("sampling.")))
    if isinstance(exc, ChatTemplateError):
        return _error_response(OpenAIError(400, str(exc), "messages"))
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first = exc.extra[0] if isinstance(exc.extra[0], dict) else {}
        param = first.get("key") or None
        return _error_response(OpenAIError(400, f"{param or 'body'}: {first.get('message')}", param))
    if isinstance(exc, HTTPException):
        return _error_response(OpenAIError(exc.status_code, str(exc.detail)))
    if isinstance(exc, ModelLoadError):
        return _error_response(OpenAIError(503, f"the model cannot be loaded: {exc}", type="server_error"))
    return _error_response(OpenAIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


# ---- from a body to engine requests ---------------------------------------------------------------------


def sampling_for(body: _Sampling, logprobs: int) -> dict[str, Any]:
    """The engine's sampling dict, checked now so that a bad value is a 400 naming the field."""
    names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "ignore_eos", "stop_token_ids")
    sampling = {k: getattr(body, k) for k in names if getattr(body, k) is not None}
    sampling["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling["logprobs"] = logprobs
    try:
        SamplingParams.model_validate(sampling)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        raise OpenAIError(400, f"{param}: {err['msg']}", param) from None
    return sampling


def check_model(request: Request, body: _Sampling) -> str:
    served = request.app.state.manager.default_model
    if body.model is not None and body.model != served:
        raise OpenAIError(404, f"model {body.model!r} is not served here; this server serves {served!r}",
                          "model", "model_not_found")
    return served


def completion_prompt(body: CompletionBody) -> str | list[int]:
    """One prompt: a string or token ids (a list holding exactly one of them is accepted too)."""
    if body.echo:
        raise OpenAIError(400, "echo: not supported by kvscope", "echo")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(400, "prompt: kvscope takes one prompt per request (use n for several samples)",
                              "prompt")
        prompt = prompt[0]
    return prompt


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages with plain-text content, as chat templates expect them."""
    out = []
    for m in messages:
        parts = m.content if isinstance(m.content, list) else [ContentPart(type="text", text=m.content or "")]
        if any(p.type != "text" for p in parts):
            raise OpenAIError(400, "messages: only text content is supported", "messages")
        out.append({**m.model_dump(exclude_none=True), "content": "".join(p.text or "" for p in parts)})
    return out


async def api_run(request: Request) -> EngineRun:
    return await asyncio.to_thread(request.app.state.manager.api_run)  # the first call loads the model


async def start_generation(run: EngineRun, body: _Sampling, prompt: str | list[int], max_tokens: int,
                           sampling: dict[str, Any], prefix: str) -> Generation:
    gen = Generation(run, body.n or 1, sampling["stop"], prefix)
    await gen.submit(prompt, max_tokens, sampling)
    return gen


# ---- OpenAI's response shapes -----------------------------------------------------------------------------


def completion_logprobs(tokens: list[dict], offset: int = 0) -> dict[str, list]:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t["text"])
    return {"tokens": [t["text"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{text: lp for _, text, lp in t.get("top_logprobs", [])} for t in tokens],
            "text_offset": offsets}


def chat_logprobs(tokens: list[dict]) -> dict[str, Any]:
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t["text"], t["logprob"]),
                         "top_logprobs": [entry(text, lp) for _, text, lp in t.get("top_logprobs", [])]}
                        for t in tokens], "refusal": None}


def _envelope(gen: Generation, object: str, model: str, choices: list[dict]) -> dict[str, Any]:
    return {"id": gen.id, "object": object, "created": gen.created, "model": model, "system_fingerprint": None,
            "choices": choices}


def completion_response(gen: Generation, model: str, logprobs: bool) -> dict[str, Any]:
    choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": completion_logprobs(c.tokens) if logprobs else None} for c in gen.choices]
    return {**_envelope(gen, "text_completion", model, choices), "usage": gen.usage()}


def chat_response(gen: Generation, model: str, logprobs: bool) -> dict[str, Any]:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                "finish_reason": c.finish_reason, "logprobs": chat_logprobs(c.tokens) if logprobs else None}
               for c in gen.choices]
    return {**_envelope(gen, "chat.completion", model, choices), "usage": gen.usage()}


async def stream_events(gen: Generation, model: str, kind: Literal["text", "chat"], logprobs: bool,
                        include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, one per finished choice, then [DONE]."""
    obj = "text_completion" if kind == "text" else "chat.completion.chunk"
    try:
        if kind == "chat":  # OpenAI opens every chat choice with the speaker's role
            yield json.dumps(_envelope(gen, obj, model, [
                {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in gen.choices]))
        async for choice, delta, token in gen.updates():
            if not delta and token is not None and not logprobs:
                continue  # held back for now (a possible stop string); it comes with a later chunk
            yield json.dumps(_envelope(gen, obj, model, [_chunk_choice(choice, delta, token, kind, logprobs)]))
        if include_usage:
            yield json.dumps({**_envelope(gen, obj, model, []), "usage": gen.usage()})
        yield "[DONE]"
    finally:
        gen.close()  # a client that disconnected mid-stream lands here: its requests are aborted


def _chunk_choice(choice: Choice, delta: str, token: dict | None, kind: str, logprobs: bool) -> dict[str, Any]:
    finish = choice.finish_reason if token is None else None
    tokens = [token] if token is not None and logprobs else []
    if kind == "text":
        offset = choice.chars - sum(len(t["text"]) for t in tokens)
        return {"index": choice.index, "text": delta, "finish_reason": finish,
                "logprobs": completion_logprobs(tokens, offset) if logprobs else None}
    return {"index": choice.index, "delta": {"content": delta} if delta else {}, "finish_reason": finish,
            "logprobs": chat_logprobs(tokens) if logprobs else None}


# ---- routes ---------------------------------------------------------------------------------------------------


@get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    name = request.app.state.manager.default_model
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvscope"}]}


@post("/completions", guards=[require_token], status_code=200)
async def completions(request: Request, data: JSONBody[CompletionBody]) -> Response:
    model = check_model(request, data)
    sampling = sampling_for(data, data.logprobs or 0)
    prompt = completion_prompt(data)
    gen = await start_generation(await api_run(request), data, prompt, data.max_tokens or 16, sampling, "cmpl")
    return await _respond(gen, data, model, "text", data.logprobs is not None)


@post("/chat/completions", guards=[require_token], status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatBody]) -> Response:
    model = check_model(request, data)
    sampling = sampling_for(data, (data.top_logprobs or 0) if data.logprobs else 0)
    messages = message_dicts(data.messages)
    run = await api_run(request)
    tokenizer, model_dir = run.sim.loaded.tokenizer, run.sim.loaded.path
    eos_text = tokenizer.token_text(tokenizer.eos_token_id) if tokenizer.eos_token_ids else ""
    prompt = await asyncio.to_thread(render_chat, messages, model_dir, eos_text)  # reads the model folder
    max_tokens = data.max_completion_tokens or data.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    gen = await start_generation(run, data, prompt, max_tokens, sampling, "chatcmpl")
    return await _respond(gen, data, model, "chat", bool(data.logprobs))


async def _respond(gen: Generation, body: _Sampling, model: str, kind: Literal["text", "chat"],
                   logprobs: bool) -> Response:
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ServerSentEvent(stream_events(gen, model, kind, logprobs, include_usage),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await gen.wait()
    finally:
        gen.close()  # cancelled (the client went away): abort; finished: nothing to do
    build = completion_response if kind == "text" else chat_response
    return Response(build(gen, model, logprobs), media_type=MediaType.JSON)


openai_routes: list = [
    Router(path="/v1", route_handlers=[list_models, completions, chat_completions],
           # Keyed like app.py's handlers, so that these (the nearer layer) win for /v1 routes.
           exception_handlers={exc: _to_openai_error for exc in (
               OpenAIError, RequestError, ChatTemplateError, HTTPException, ModelLoadError, Exception)},
           tags=["OpenAI-compatible"]),
]
