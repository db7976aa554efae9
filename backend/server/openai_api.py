"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Close enough to OpenAI's wire format that the official `openai` client works unchanged. A request's
`model` picks a model by name: the server's own (the default), a shipped one, or `smollm2` when its
package is installed. Every request joins its model's open-ended run ("api" for the server's model,
"api-NAME" for another), so the dashboard can watch it being scheduled, paged and sampled. The
engine lives on that run's worker thread and hands each request's outputs (tokens, finish) to the
request's listener there, which puts them on the request's asyncio queue; the trace's events are
the dashboard's, never the answer.

A service left running: a full waiting queue is a 429 with Retry-After; a request still running after
--request-timeout-s is aborted (a stream ends with finish_reason "abort", a plain answer is a 504);
a client that goes away has its requests aborted, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from litestar import MediaType, Request, Response, Router, get, post
from litestar.exceptions import HTTPException, ValidationException
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler,
                      field_validator, model_validator)

from kvscope.backend.engine.request import RequestError, check_prompt_ids
from kvscope.backend.engine.sampling_params import MAX_STOP_CHARS, MAX_STOPS, SamplingParams, StopString
from kvscope.backend.errors import pydantic_reason, validation_error
from kvscope.backend.model.chat import ChatTemplateError, encode_chat, reads_tools
from kvscope.backend.model.loader import ModelLoadError, missing_package
from kvscope.backend.server.limits import WeightMemoryError
from kvscope.backend.server.guards import require_token  # off-loopback, the server token is the client's api_key
from kvscope.backend.server.generation import Choice, Generation, prompt_logprobs
from kvscope.backend.server.engine_run import EngineRun
from kvscope.backend.server.run_errors import RunBusy, RunError, RunFailed
from kvscope.backend.server.structured import (ChoiceList, Grammar, GrammarText, ResponseFormat, Schema,
                                               StructuredOutputsField, grammar_of, named_by_source)
from kvscope.backend.server.tool_parser import Parser, ToolCallStream, chat_message
from kvscope.backend.server.tools import ToolCall, ToolCalling, ToolChoice, Tools

NewParser = Callable[[], Parser | None]  # a reader of one choice's tool calls; None: plain content

DEFAULT_CHAT_MAX_TOKENS = 256  # OpenAI's is "the rest of the context"; the demo models stop long before


# ---- bodies -----------------------------------------------------------------------------------------------
# OpenAI's fields that kvscope implements, or that cannot change the output (ids for OpenAI's records);
# any other field is refused with a 400 naming it, never silently ignored. A null counts as absent.

MAX_PROMPT_CHARS = 100_000
MAX_PROMPT_TOKENS = 100_000
MAX_PROMPTS = 64
MAX_CHOICES = 64  # prompts x n
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
Name = Annotated[str, Field(max_length=256)]


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None or k in cls.model_fields} \
            if isinstance(data, dict) else data


class StreamOptions(StrictBody):
    include_usage: bool = False  # a last chunk with the usage; the chunks before it carry `usage: null`
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Sampling(StrictBody):
    model: Name | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=100_000)
    temperature: float | None = None  # bounds: SamplingParams, the engine's one definition of them
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, lt=2**31)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None  # vLLM's extras, handy to watch a long generation
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    n: int | None = Field(default=None, ge=1, le=16)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=1024)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Name | None = None  # an end user's id, for OpenAI's abuse monitoring: nothing to act on here

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_strings(cls, stop: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(stop)
        except ValidationError:  # pydantic's message names a branch of the union: say what is expected
            raise ValueError(f"a string or a list of up to {MAX_STOPS}, each of 1..{MAX_STOP_CHARS} characters "
                             "(an empty one would end every answer before it starts)") from None

    def refuse_unimplemented(self) -> None:
        """400 for a value kvscope cannot honour (fields it does not know at all fail validation)."""
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options: only allowed when stream is true", "stream_options")


class CompletionBody(_Sampling):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=16)
    suffix: Text | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_shape(cls, prompt: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(prompt)
        except ValidationError:  # pydantic's message names a branch of the union: say what is expected
            raise ValueError(f"a string or a list of token ids (up to {MAX_PROMPT_CHARS} characters or "
                             f"{MAX_PROMPT_TOKENS} ids), or a list of up to {MAX_PROMPTS} of one of these") from None

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.suffix:
            raise OpenAIError(400, "suffix: not supported by kvscope (it does not insert text)", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError(400, "best_of: kvscope returns every sample it draws; best_of must equal n",
                              "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens: must be at least 1 (0 only with echo)", "max_tokens")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string or token-id list per prompt."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ContentPart(StrictBody):
    type: Annotated[str, Field(max_length=32)]
    text: Text | None = None
    # Parts kvscope's text-only models cannot read: declared so that they are refused by name
    # (message_dicts), not as fields the body does not know.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


UNREADABLE_PARTS = {"image_url": "images are not supported by this model",
                    "input_audio": "audio is not supported by this model",
                    "file": "files are not supported by this model"}
# The roles OpenAI's chat API defines; "developer" is its newer name for "system" and reaches the template as that.
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(StrictBody):
    role: Role
    content: Text | Annotated[list[ContentPart], Field(max_length=64)] | None = None
    name: Name | None = None
    refusal: Text | None = None  # as the client echoes an earlier answer back
    tool_calls: Annotated[list[ToolCall], Field(max_length=64)] | None = None  # an earlier answer's calls
    tool_call_id: Name | None = None  # a tool message: the call it answers


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=100_000)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's grammar fields: structured.py
    guided_json: Schema | None = None
    guided_regex: GrammarText | None = None
    guided_choice: ChoiceList | None = None
    guided_grammar: GrammarText | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Annotated[str, Field(max_length=16)]] | None = Field(default=None, max_length=4)
    store: bool | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)  # only kept with store, which kvscope refuses
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None  # kvscope's prefix cache needs no hint

    def refuse_unimplemented(self) -> None:
        super().refuse_unimplemented()
        if self.max_tokens == 0:
            raise OpenAIError(400, "max_tokens: must be at least 1", "max_tokens")
        refused = {"modalities": self.modalities not in (None, ["text"]),
                   "store": bool(self.store),
                   "service_tier": self.service_tier not in (None, "auto", "default")}
        for param, is_refused in refused.items():
            if is_refused:
                raise OpenAIError(400, f"{param}: {getattr(self, param)!r} is not supported by kvscope", param)


# ---- errors in OpenAI's shape ---------------------------------------------------------------------------


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}


def _error_response(e: OpenAIError) -> Response:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return Response(body, status_code=e.status, media_type=MediaType.JSON, headers=e.headers)


def _to_openai_error(_: Request, exc: Exception) -> Response:
    """One edge for every failure of these routes: user errors are 4xx, never 5xx."""
    if isinstance(exc, OpenAIError):
        return _error_response(exc)
    if isinstance(exc, RequestError):  # the engine's field names are "sampling.x" where OpenAI's are "x"
        return _error_response(OpenAIError(400, str(exc), exc.field.removeprefix("sampling.")))
    if isinstance(exc, RunBusy):
        return _error_response(OpenAIError(429, str(exc), None, "rate_limit_exceeded", "rate_limit_error",
                                           {"Retry-After": str(exc.retry_after_s)}))
    if isinstance(exc, WeightMemoryError):  # the model the client named needs weights the server has no room for
        return _error_response(OpenAIError(400, str(exc), "model"))
    if isinstance(exc, RunFailed):
        return _error_response(run_failed(exc))
    if isinstance(exc, RunError):  # the API's run could not start: the server's limits, not the request
        return _error_response(OpenAIError(503, str(exc), type="server_error"))
    if isinstance(exc, ChatTemplateError):
        return _error_response(OpenAIError(400, str(exc), "messages"))
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first = exc.extra[0] if isinstance(exc.extra[0], dict) else {}
        param = first.get("key") or None
        message = pydantic_reason(str(first.get("message")))
        if message == "Extra inputs are not permitted":  # pydantic's words for a field the body does not declare
            message = "not supported by kvscope"
        return _error_response(OpenAIError(400, f"{param or 'body'}: {message}", param))
    if isinstance(exc, HTTPException):
        return _error_response(OpenAIError(exc.status_code, str(exc.detail)))
    if isinstance(exc, ModelLoadError):
        return _error_response(OpenAIError(503, f"the model cannot be loaded: {exc}", type="server_error"))
    return _error_response(OpenAIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def run_failed(exc: RunFailed) -> OpenAIError:
    """The run failed under the request: a 409 (the run's state, not the request, was at fault; never a 5xx,
    so a failing run cannot pass for a failing server), which the official client retries on a fresh run."""
    return OpenAIError(409, f"the server's run failed under this request ({exc.cause}); the next request starts "
                            "a fresh run: try again", None, "run_failed", "server_error", {"Retry-After": "1"})


def openai_errors_under_v1(handler: Callable[[Request, Exception], Response]) -> Callable[[Request, Exception], Response]:
    """An app-level handler that answers in OpenAI's shape under /v1 (404s and 405s never reach the /v1 router)."""

    def answer(request: Request, exc: Exception) -> Response:
        if request.url.path == "/v1" or request.url.path.startswith("/v1/"):
            return _to_openai_error(request, exc)
        return handler(request, exc)

    return answer


# ---- from a body to engine requests ---------------------------------------------------------------------


def sampling_for(body: StrictBody, logprobs: int, grammar: Grammar | None = None) -> dict[str, Any]:
    """The engine's sampling dict, checked now so that a bad value is a 400 naming the field.

    A body without one of these fields (the Responses API has no `stop`, no `seed`) leaves it at its default."""
    names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "ignore_eos", "stop_token_ids", "logit_bias")
    sampling = {k: getattr(body, k) for k in names if getattr(body, k, None) is not None}
    stop = getattr(body, "stop", None)
    sampling["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    sampling["logprobs"] = logprobs
    if grammar is not None:
        sampling["structured_outputs"] = grammar.outputs
    try:
        SamplingParams.model_validate(sampling)
    except ValidationError as e:
        error = validation_error(e)
        raise OpenAIError(400, str(error), error.field) from None
    return sampling


def check_model(request: Request, body: StrictBody) -> str:
    """The model a request names (the server's own when it names none); 404 for one not served."""
    manager = request.app.state.manager
    name = body.model or manager.default_model
    if name not in manager.api_models():
        raise model_not_found(name, manager.api_models())
    return name


def model_not_found(name: str, served: list[str]) -> OpenAIError:
    install = missing_package(name)
    reason = f"is not installed (run: {install})" if install else \
        f"is not served here; this server serves {', '.join(map(repr, served))}"
    return OpenAIError(404, f"model {name!r} {reason}", "model", "model_not_found")


def fit_in_context(run: EngineRun, prompt_len: int, asked: int | None, default: int, prompt_param: str,
                   max_param: str) -> int:
    """max_tokens for a prompt of prompt_len tokens: as asked, or the default cut to the context left.

    As OpenAI: a prompt plus max_tokens beyond the context is a 400, not a silently shorter answer."""
    context = run.max_model_len
    room = context - prompt_len
    if room < 1:
        raise OpenAIError(400, f"{prompt_param}: {prompt_len} tokens leave no room under max_model_len={context}",
                          prompt_param, "context_length_exceeded")
    if asked is None:
        return min(default, room)
    if asked > room:
        raise OpenAIError(400, f"{max_param}: {prompt_len} prompt tokens + {max_param}={asked} exceed the model's "
                               f"context (max_model_len={context}); ask for at most {room}",
                          max_param, "context_length_exceeded")
    return asked


def token_ids(run: EngineRun, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids; ids sent as such are checked against the vocabulary now, before an echo's
    forward pass reads them (RequestError naming `prompt`)."""
    if isinstance(prompt, str):
        return run.loaded.tokenizer.encode(prompt)
    check_prompt_ids(prompt, run.loaded.config.vocab_size)
    return prompt


async def set_echo(run: EngineRun, gen: Generation, prompts: list[str | list[int]], ids: list[list[int]],
                   logprobs: int | None) -> None:
    """Each choice starts with its prompt; with logprobs, each prompt token's too (one forward per prompt)."""
    loaded = run.loaded
    for k, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
        text = prompt if isinstance(prompt, str) else loaded.tokenizer.decode(prompt_ids)
        tokens = [] if logprobs is None or not prompt_ids else await asyncio.to_thread(
            run.call, lambda i=prompt_ids: prompt_logprobs(loaded, i, logprobs))  # beside the engine, not racing it
        for choice in gen.choices[k * gen.n:(k + 1) * gen.n]:
            choice.echo, choice.echo_tokens, choice.chars = text, tokens, len(text)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages with plain-text content, as chat templates expect them (tools.py adds the tool calls' shape)."""
    out = []
    for i, m in enumerate(messages):
        parts = m.content if isinstance(m.content, list) else [ContentPart(type="text", text=m.content or "")]
        for j, part in enumerate(parts):
            if part.type != "text":
                reason = UNREADABLE_PARTS.get(part.type, f"{part.type!r} parts are not supported; send text parts")
                raise OpenAIError(400, f"messages.{i}.content.{j}: {reason}", f"messages.{i}.content.{j}.type")
        role = "system" if m.role == "developer" else m.role
        out.append({**m.model_dump(exclude_none=True), "role": role, "content": "".join(p.text or "" for p in parts)})
    return out


async def api_run(request: Request, model: str, num_requests: int) -> EngineRun:
    """The API's run for `model` (the first call loads it); RunBusy if its queue cannot take num_requests."""
    run = await asyncio.to_thread(request.app.state.manager.api_run, model)
    run.check_room(num_requests)
    return run


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- OpenAI's response shapes -----------------------------------------------------------------------------


def completion_logprobs(tokens: list[dict], offset: int = 0) -> dict[str, list]:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t["text"])
    return {"tokens": [t["text"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [_top_by_text(t) for t in tokens], "text_offset": offsets}


def _top_by_text(token: dict) -> dict[str, float] | None:
    """A token's top_logprobs by text, the token itself among them as vLLM lists them (even outside the
    top n); None for an echoed prompt's first token, which has no distribution."""
    top = token.get("top_logprobs", [])
    return None if top is None else {**{text: lp for _, text, lp in top}, token["text"]: token["logprob"]}


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
    choices = [{"index": c.index, "text": c.echo + c.text, "finish_reason": c.finish_reason,
                "logprobs": completion_logprobs(c.echo_tokens + c.tokens) if logprobs else None}
               for c in gen.choices]
    return {**_envelope(gen, "text_completion", model, choices), "usage": gen.usage()}


def chat_response(gen: Generation, model: str, logprobs: bool, new_parser: NewParser) -> dict[str, Any]:
    choices = []
    for c in gen.choices:
        parser = new_parser()
        message, finish = ({"role": "assistant", "content": c.text, "refusal": None}, c.finish_reason) \
            if parser is None else chat_message(parser, c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "finish_reason": finish,
                        "logprobs": chat_logprobs(c.tokens) if logprobs else None})
    return {**_envelope(gen, "chat.completion", model, choices), "usage": gen.usage()}


def sse(data: AsyncIterator[str | ServerSentEventMessage]) -> ServerSentEvent:
    """Server-sent events framed as OpenAI and vLLM frame them: `data: ...` (after `event: ...` for the
    Responses API's named events) and a blank line, `\n` only (litestar's default `\r\n` leaves a parser
    that splits on `\n\n` with one blob)."""
    async def messages() -> AsyncIterator[ServerSentEventMessage]:
        async for payload in data:
            message = payload if isinstance(payload, ServerSentEventMessage) else ServerSentEventMessage(data=payload)
            message.sep = "\n"
            yield message

    return ServerSentEvent(messages(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(gen: Generation, model: str, kind: Literal["text", "chat"], logprobs: bool,
                        options: StreamOptions | None, new_parser: NewParser) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, one per finished choice, then [DONE].

    With `include_usage` every chunk has a `usage` key: null until the last chunk, which has no choices
    and the whole usage (OpenAI's); with vLLM's `continuous_usage_stats` too, each carries the usage so far."""
    obj = "text_completion" if kind == "text" else "chat.completion.chunk"
    calls = {c.index: ToolCallStream(p) for c in gen.choices if (p := new_parser()) is not None}
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)

    def chunk_of(choices: list[dict]) -> str:
        usage = {"usage": gen.usage() if continuous else None} if include_usage else {}
        return json.dumps({**_envelope(gen, obj, model, choices), **usage})

    try:
        for opening in _opening_chunks(gen, kind, logprobs):
            yield chunk_of([opening])
        try:
            async for choice, delta, token in gen.updates():
                chunk = _chunk_choice(choice, delta, token, kind, logprobs, calls.get(choice.index))
                if token is not None and not logprobs and not chunk["text" if kind == "text" else "delta"]:
                    continue  # held back for now (a possible stop string or tool call); it comes with a later chunk
                yield chunk_of([chunk])
            if include_usage:
                yield json.dumps({**_envelope(gen, obj, model, []), "usage": gen.usage()})
        except RunFailed as e:  # the status line is sent: the error goes in the stream (as vLLM's), then [DONE]
            error = run_failed(e)
            yield json.dumps({"error": {"message": error.message, "type": error.type, "param": None,
                                        "code": error.code}})
        yield "[DONE]"
    finally:
        gen.close()  # a client that disconnected mid-stream lands here: its requests are aborted


def _opening_chunks(gen: Generation, kind: str, logprobs: bool) -> list[dict[str, Any]]:
    """Chat opens every choice with the speaker's role; an echoing completion with its prompt."""
    if kind == "chat":
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for c in gen.choices]
    return [{"index": c.index, "text": c.echo, "finish_reason": c.finish_reason,
             "logprobs": completion_logprobs(c.echo_tokens) if logprobs else None} for c in gen.choices if c.echo]


def _chunk_choice(choice: Choice, delta: str, token: dict | None, kind: str, logprobs: bool,
                  calls: ToolCallStream | None) -> dict[str, Any]:
    finish = choice.finish_reason if token is None else None
    tokens = [token] if token is not None and logprobs else []
    if kind == "text":
        offset = choice.chars - sum(len(t["text"]) for t in tokens)
        return {"index": choice.index, "text": delta, "finish_reason": finish,
                "logprobs": completion_logprobs(tokens, offset) if logprobs else None}
    if calls is not None:
        fields = calls.delta(delta, token is None)
        finish = calls.finish_reason(finish)  # after the delta: the last one may hold the calls
    else:
        fields = {"content": delta} if delta else {}
    return {"index": choice.index, "delta": fields, "finish_reason": finish,
            "logprobs": chat_logprobs(tokens) if logprobs else None}


# ---- routes ---------------------------------------------------------------------------------------------------


def model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvscope"}


@get("/models", sync_to_thread=True)  # looks for installed packages on disk
def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(m) for m in request.app.state.manager.api_models()]}


@get("/models/{model_id:path}", sync_to_thread=True)
def retrieve_model(request: Request, model_id: FromPath[str]) -> dict[str, Any]:
    served = request.app.state.manager.api_models()
    name = model_id.removeprefix("/")
    if name not in served:
        raise model_not_found(name, served)
    return model_card(name)


@post("/completions", guards=[require_token], status_code=200)
async def completions(request: Request, data: JSONBody[CompletionBody]) -> Response:
    data.refuse_unimplemented()
    model = check_model(request, data)
    prompts, n = data.prompts(), data.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise OpenAIError(400, f"n: {len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices", "n")
    run = await api_run(request, model, len(prompts))
    sampling = sampling_for(data, data.logprobs or 0)
    ids = await asyncio.to_thread(lambda: [token_ids(run, p) for p in prompts])
    if not all(ids):
        raise OpenAIError(400, "prompt: empty prompt", "prompt")
    max_tokens = [fit_in_context(run, len(i), data.max_tokens, 16, "prompt", "max_tokens") for i in ids]
    gen = Generation(run, n, sampling["stop"], "cmpl", len(prompts))
    if data.echo:
        await set_echo(run, gen, prompts, ids, data.logprobs)
    if data.max_tokens == 0:  # echo alone: scoring a text, nothing to generate
        gen.skip_generation([len(i) for i in ids])
    else:
        await gen.submit(list(zip(prompts, max_tokens)), sampling)
    return await _respond(request, gen, data, model, "text", data.logprobs is not None, lambda: None)


@post("/chat/completions", guards=[require_token], status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatBody]) -> Response:
    data.refuse_unimplemented()
    calling = ToolCalling.of(data)
    grammar = grammar_of(data, calling.forced_schema())  # before any work: the schemas' sizes are checked
    model = check_model(request, data)
    run = await api_run(request, model, 1)
    sampling = sampling_for(data, (data.top_logprobs or 0) if data.logprobs else 0, grammar)
    messages, tools = calling.template_inputs(message_dicts(data.messages), reads_tools(run.loaded))
    prompt = await asyncio.to_thread(encode_chat, messages, run.loaded, tools)  # reads the model folder
    prompt_len = len(prompt)
    asked = data.max_completion_tokens or data.max_tokens
    max_param = "max_completion_tokens" if data.max_completion_tokens else "max_tokens"
    max_tokens = fit_in_context(run, prompt_len, asked, DEFAULT_CHAT_MAX_TOKENS, "messages", max_param)
    gen = Generation(run, data.n or 1, sampling["stop"], "chatcmpl")
    with named_by_source(grammar):
        await gen.submit([(prompt, max_tokens)], sampling)
    return await _respond(request, gen, data, model, "chat", bool(data.logprobs), calling.parser)


async def _respond(request: Request, gen: Generation, body: _Sampling, model: str, kind: Literal["text", "chat"],
                   logprobs: bool, new_parser: NewParser) -> Response:
    events = stream_events(gen, model, kind, logprobs, body.stream_options, new_parser) if body.stream else None
    return await respond(request, gen, events, lambda: completion_response(gen, model, logprobs) if kind == "text"
                         else chat_response(gen, model, logprobs, new_parser))


async def respond(request: Request, gen: Generation, events: AsyncIterator[Any] | None,
                  answer: Callable[[], dict[str, Any]]) -> Response:
    """A submitted generation's answer: its events as a stream, or `answer()` once every choice has finished.

    Either way the server's time limit and a client that goes away abort it (every route that generates
    answers through here, so none can leak a request that nobody reads)."""
    timeout = request.app.state.manager.limits.request_timeout_s
    gen.limit_time(timeout)
    if events is not None:
        return sse(events)
    gone = asyncio.ensure_future(client_gone(request))
    done = asyncio.ensure_future(gen.wait())
    try:
        await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        done.cancel()
        gen.close()  # the client went away (or the handler was cancelled): abort; finished: nothing to do
    if not done.done() or done.cancelled():
        return Response(None, status_code=499)  # nobody is listening: nginx's "client closed request"
    done.result()
    if gen.timed_out:
        raise OpenAIError(504, f"the request ran past the server's time limit (--request-timeout-s {timeout:g}) "
                               "and was aborted", None, "timeout", "timeout_error")
    return Response(answer(), media_type=MediaType.JSON)


# Keyed like app.py's handlers, so that these (the nearer layer) win for the routes they are given.
OPENAI_ERROR_HANDLERS: dict = {exc: _to_openai_error for exc in (
    OpenAIError, RequestError, ChatTemplateError, HTTPException, ModelLoadError, RunBusy, RunError, RunFailed,
    Exception)}


def v1_router(handlers: list) -> Router:
    """A router under /v1 whose every failure is answered in OpenAI's shape."""
    return Router(path="/v1", route_handlers=handlers, exception_handlers=OPENAI_ERROR_HANDLERS,
                  tags=["OpenAI-compatible"])


openai_routes: list = [v1_router([list_models, retrieve_model, completions, chat_completions])]
