"""OpenAI's Responses API, `POST /v1/responses`: one answer to a conversation, as chat completions give,
in the newer shape the official clients' `responses.create/stream/parse` speak.

What it is, next to chat: the same request underneath (the conversation through the model's chat
template, one engine request, the same time limit, disconnect handling and grammar-constrained
sampling: openai_api.respond, structured.py), written out differently:

    request   input (a string, or a list of messages) + instructions (a system message first),
              max_output_tokens, temperature, top_p, text.format (text | json_object | json_schema)
    response  {"object": "response", "status": "completed" | "incomplete", "output": [message item],
               "usage": {"input_tokens", "output_tokens", "total_tokens", *_tokens_details}}
              message item: {"type": "message", "role": "assistant", "content": [{"type": "output_text",
              "text": ...}]}: a list of items, because OpenAI's models answer with tool calls and reasoning
              items too; kvscope's answer is always exactly one message.
    stream    named server-sent events, each `data` carrying its `type` and a `sequence_number`:
              response.created, response.in_progress, response.output_item.added,
              response.content_part.added, response.output_text.delta (one per chunk of text),
              response.output_text.done, response.content_part.done, response.output_item.done, and
              last response.completed, or response.incomplete when max_output_tokens cut the answer
              (or response.failed when the run failed or the time limit aborted it).

OpenAI keeps responses on its side (`store`, `previous_response_id`, `conversation`, `background`) and
runs tools and reasoning; kvscope keeps nothing and runs neither, so each of those fields is a 400 that
names it and says why, never silently ignored. Fields the body does not declare are refused by
validation, as on the chat route.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response.sse import ServerSentEventMessage
from pydantic import BaseModel, Field, ValidationError, model_validator

from kvscope.backend.errors import pydantic_reason
from kvscope.backend.model.chat import ChatTemplateError, encode_chat
from kvscope.backend.server.generation import Generation
from kvscope.backend.server.guards import require_token
from kvscope.backend.server.openai_api import (DEFAULT_CHAT_MAX_TOKENS, Name, OpenAIError, StrictBody, Text, api_run,
                                               check_model, fit_in_context, respond, run_failed, sampling_for,
                                               v1_router)
from kvscope.backend.server.run_errors import RunFailed
from kvscope.backend.server.structured import (FunctionName, Grammar, JsonSchemaFormat, ResponseFormat, check_size,
                                               format_grammar, named_by_source, one_reason)

MAX_ITEMS = 256
# "developer" is OpenAI's newer name for "system"; the chat templates kvscope serves know only "system".
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
NOT_STORED = "kvscope keeps no responses: send the whole conversation as `input`"


# ---- the request ----------------------------------------------------------------------------------------


class TextFormat(StrictBody):
    """`text.format`: chat's response_format, with a schema's fields beside `type` rather than under `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Annotated[str, Field(max_length=4096)] | None = None
    strict: bool | None = None  # kvscope always enforces the schema (structured.py)

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError("name and schema are required with type json_schema, and only with it")
        return self

    def as_response_format(self) -> ResponseFormat:
        schema = None if self.type != "json_schema" else JsonSchemaFormat(
            name=self.name, schema=self.schema_, description=self.description, strict=self.strict)
        return ResponseFormat(type=self.type, json_schema=schema)


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(StrictBody):
    include_obfuscation: bool | None = None
    include_usage: bool | None = None  # what benchmark tools send (aiperf): the final event always has the usage


class InputPart(StrictBody):
    """A message's text; an earlier answer sent back as input carries its output_text's annotations too."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = None
    logprobs: Annotated[list[dict[str, Any]], Field(max_length=100_000)] | None = None


class InputMessage(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[Text | Annotated[list[dict[str, Any]], Field(max_length=64)],
                       one_reason("a string, or a list of up to 64 input_text / output_text parts")]
    id: Name | None = None  # an earlier output item sent back: its id, status and phase change nothing
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


Input = Annotated[Annotated[str, Field(min_length=1, max_length=100_000)]
                  | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_ITEMS)],
                  one_reason(f"a non-empty string, or a list of 1..{MAX_ITEMS} messages")]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class ResponsesBody(StrictBody):
    model: Name | None = None
    input: Input
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=100_000)  # OpenAI's minimum is 16
    temperature: float | None = None  # bounds: SamplingParams
    top_p: float | None = None
    ignore_eos: bool | None = None  # vLLM's extra, as on the other routes (guidellm sends it to fix output lengths)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None  # echoed back, as OpenAI does
    user: Name | None = None  # ids for OpenAI's abuse monitoring: nothing to act on here
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None  # kvscope's prefix cache needs no hint
    service_tier: Annotated[str, Field(max_length=32)] | None = None
    parallel_tool_calls: bool | None = None  # with no tools there are no calls to run in parallel
    tool_choice: Annotated[str, Field(max_length=32)] | dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Declared only to be refused with a reason (refuse_unimplemented).
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: Name | None = None
    conversation: Name | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=16)] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def refuse_unimplemented(self) -> None:
        """400 naming the first field kvscope cannot honour, and why."""
        verbosity = self.text.verbosity if self.text else None
        obfuscation = self.stream_options.include_obfuscation if self.stream_options else None
        refused = {
            "tools": (bool(self.tools), "the Responses route runs no tools; /v1/chat/completions calls functions"),
            "tool_choice": (self.tool_choice not in (None, "auto", "none"), "there are no tools to choose"),
            "store": (bool(self.store), NOT_STORED),
            "previous_response_id": (self.previous_response_id is not None, NOT_STORED),
            "conversation": (self.conversation is not None, NOT_STORED),
            "background": (bool(self.background), "kvscope answers within the request"),
            "reasoning": (self.reasoning is not None, "the served models have no reasoning mode"),
            "include": (bool(self.include), "kvscope has no extra output items to include"),
            "prompt": (self.prompt is not None, "kvscope keeps no prompt templates"),
            "top_logprobs": (bool(self.top_logprobs), "logprobs are served by /v1/chat/completions"),
            "truncation": (self.truncation == "auto",
                           "kvscope never drops the start of a conversation: one too long is a 400"),
            "service_tier": (self.service_tier not in (None, "auto", "default"), "kvscope has one tier"),
            "text.verbosity": (verbosity not in (None, "medium"), "the served models have no verbosity setting"),
            "stream_options": (self.stream_options is not None and not self.stream,
                               "only allowed when stream is true"),
            "stream_options.include_obfuscation": (bool(obfuscation), "kvscope does not pad its stream events"),
        }
        for param, (is_refused, why) in refused.items():
            if is_refused:
                raise OpenAIError(400, f"{param}: not supported by kvscope: {why}", param)

    def grammar(self) -> Grammar | None:
        """The grammar `text.format` asks for, its size checked (RequestError naming text.format)."""
        fmt = self.text.format if self.text else None
        grammar = format_grammar(fmt.as_response_format(), "text.format") if fmt else None
        if grammar is not None:
            check_size(grammar)
        return grammar

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages: the instructions as a system message first, then the input."""
        first = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*first, {"role": "user", "content": self.input}]
        return [*first, *(_message(item, f"input[{i}]") for i, item in enumerate(self.input))]


def _message(item: dict[str, Any], where: str) -> dict[str, str]:
    kind = item.get("type", "message")
    if kind != "message":  # function_call, function_call_output, reasoning, item_reference, ...
        raise OpenAIError(400, f"{where}: {str(kind)[:64]!r} items are not supported by kvscope (it runs no tools, "
                               "keeps no items to refer to: only messages)", f"{where}.type")
    message = _validated(InputMessage, item, where)
    if isinstance(message.content, str):
        return {"role": ROLES[message.role], "content": message.content}
    texts = [_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(message.content)]
    return {"role": ROLES[message.role], "content": "".join(texts)}


def _part_text(part: dict[str, Any], where: str) -> str:
    kind = part.get("type")
    if kind in ("input_image", "input_file", "input_audio"):
        raise OpenAIError(400, f"{where}: {kind} parts are not supported by kvscope (it serves text models)",
                          f"{where}.type")
    return _validated(InputPart, part, where).text


def _validated(model: type[BaseModel], value: dict[str, Any], where: str) -> Any:
    """An item of `input` (validated here, not by the route: the error names its place, `input[2].role`)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        param = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        reason = pydantic_reason(first["msg"])
        if reason == "Extra inputs are not permitted":
            reason = "not supported by kvscope"
        raise OpenAIError(400, f"{param}: {reason}", param) from None


# ---- the response -----------------------------------------------------------------------------------------


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(gen: Generation, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id(gen), "type": "message", "role": "assistant", "status": status, "content": content}


def item_id(gen: Generation) -> str:
    return "msg" + gen.id.removeprefix("resp")


def response_object(gen: Generation, body: ResponsesBody, model: str, status: str, **fields: Any) -> dict[str, Any]:
    """The response as OpenAI writes it, with the request's settings echoed (`output` empty until it ends)."""
    fmt = body.text.format if body.text and body.text.format else TextFormat(type="text")
    return {"id": gen.id, "object": "response", "created_at": gen.created, "status": status, "model": model,
            "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tools": [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "truncation": "disabled", "store": False, "background": False,
            "previous_response_id": None, "reasoning": None, "usage": None, "user": body.user,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "service_tier": body.service_tier or "default", **fields}


def final_response(gen: Generation, body: ResponsesBody, model: str) -> dict[str, Any]:
    """The finished response: `incomplete` when max_output_tokens cut the answer (finish reason "length"),
    `failed` when it was aborted (the server's time limit, a shutdown)."""
    choice = gen.choices[0]
    if choice.finish_reason == "abort":
        why = "ran past the server's time limit" if gen.timed_out else "was aborted by the server"
        return failed(gen, body, model, f"the request {why}")
    cut = choice.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    usage = gen.usage()
    return response_object(
        gen, body, model, status, output=[message_item(gen, status, [text_part(choice.text)])],
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        completed_at=None if cut else gen.created,
        usage={"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
               "total_tokens": usage["total_tokens"],
               # no reasoning; no cache writes to count (the prefix cache keeps every full block anyway)
               "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                        "cache_write_tokens": 0},
               "output_tokens_details": {"reasoning_tokens": 0}})


def failed(gen: Generation, body: ResponsesBody, model: str, message: str) -> dict[str, Any]:
    return response_object(gen, body, model, "failed", error={"code": "server_error", "message": message})


async def stream_events(gen: Generation, body: ResponsesBody, model: str) -> AsyncIterator[ServerSentEventMessage]:
    """The event sequence of one message with one text part (the module's docstring); aborted if the client leaves."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> ServerSentEventMessage:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return ServerSentEventMessage(data=json.dumps(data), event=kind)

    where = {"item_id": item_id(gen), "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=response_object(gen, body, model, "in_progress"))
        yield event("response.in_progress", response=response_object(gen, body, model, "in_progress"))
        yield event("response.output_item.added", output_index=0, item=message_item(gen, "in_progress", []))
        yield event("response.content_part.added", **where, part=text_part(""))
        try:
            async for _, delta, _ in gen.updates():
                if delta:  # empty: a character still incomplete, it comes with the next token
                    yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
        except RunFailed as e:
            yield event("response.failed", response=failed(gen, body, model, run_failed(e).message))
            return
        final = final_response(gen, body, model)
        if final["status"] == "failed":
            yield event("response.failed", response=final)
            return
        (item,) = final["output"]
        text = item["content"][0]["text"]
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=text_part(text))
        yield event("response.output_item.done", output_index=0, item=item)
        yield event(f"response.{final['status']}", response=final)  # response.completed or response.incomplete
    finally:
        gen.close()  # a client that disconnected mid-stream lands here: its request is aborted


# ---- the route --------------------------------------------------------------------------------------------


@post("/responses", guards=[require_token], status_code=200)
async def create_response(request: Request, data: JSONBody[ResponsesBody]) -> Response:
    data.refuse_unimplemented()
    messages = data.messages()  # before any work: a malformed item is a 400 naming its place
    grammar = data.grammar()
    model = check_model(request, data)
    run = await api_run(request, model, 1)
    sampling = sampling_for(data, 0, grammar)
    try:
        prompt = await asyncio.to_thread(encode_chat, messages, run.loaded)  # reads the model folder
    except ChatTemplateError as e:  # chat's handler would name `messages`: here the client sent `input`
        raise OpenAIError(400, str(e), "input") from None
    max_tokens = fit_in_context(run, len(prompt), data.max_output_tokens, DEFAULT_CHAT_MAX_TOKENS, "input",
                                "max_output_tokens")
    gen = Generation(run, 1, [], "resp")
    with named_by_source(grammar):
        await gen.submit([(prompt, max_tokens)], sampling)
    events = stream_events(gen, data, model) if data.stream else None
    return await respond(request, gen, events, lambda: final_response(gen, data, model))


responses_routes: list = [v1_router([create_response])]
