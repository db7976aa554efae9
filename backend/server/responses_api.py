"""OpenAI's Responses API, `POST /v1/responses`: one answer to a conversation, as chat completions give,
in the newer shape the official clients' `responses.create/stream/parse` and the OpenAI Agents SDK speak.

What it is, next to chat: the same request underneath (the conversation and the function tools through
the model's chat template, one engine request, the same time limit, disconnect handling, tool-call
reading and grammar-constrained sampling: openai_serving.respond, tools.py, tool_parser.py,
structured.py), written out differently:

    request   input (a string, or a list of message, function_call and function_call_output items) +
              instructions (a system message first), tools (functions), tool_choice, parallel_tool_calls,
              max_output_tokens, temperature, top_p, text.format (text | json_object | json_schema),
              store and previous_response_id (response_store.py)
    response  {"object": "response", "status": "completed" | "incomplete", "output": [items],
               "usage": {"input_tokens", "output_tokens", "total_tokens", *_tokens_details}}
              items: messages {"type": "message", "role": "assistant", "content": [{"type": "output_text",
              "text": ...}]} and calls {"type": "function_call", "call_id", "name", "arguments"}
              (responses_items.py)
    stream    named server-sent events, each `data` carrying its `type` and a `sequence_number`:
              response.created, response.in_progress, then each item's events as responses_items.py
              writes them, and last response.completed, or response.incomplete when max_output_tokens
              cut the answer (or response.failed when the run failed, the time limit aborted it, or the
              request failed by its own fault: its grammar allowed no token; the error's `code` says which).

The body and its refusals are responses_protocol.py's; what a body becomes in the engine, and the
answer's time limit and disconnect handling, are openai_serving.py's, as for chat.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response.sse import ServerSentEventMessage

from kvscope.backend.model.chat import ChatTemplateError, encode_chat, reads_tools
from kvscope.backend.server.generation import Generation
from kvscope.backend.server.guards import require_token
from kvscope.backend.server.openai_errors import OpenAIError, request_failed, run_failed, v1_router
from kvscope.backend.server.openai_protocol import ChatMessage
from kvscope.backend.server.openai_serving import (DEFAULT_CHAT_MAX_TOKENS, api_run, compiled_grammar, fit_in_context,
                                                   message_dicts, respond, sampling_for, served_model)
from kvscope.backend.server.response_store import ResponseStore
from kvscope.backend.server.responses_items import OutputItems
from kvscope.backend.server.responses_protocol import ResponsesBody, TextFormat
from kvscope.backend.server.run_errors import RequestFailed, RunFailed
from kvscope.backend.server.structured import named_by_source
from kvscope.backend.server.tool_parser import Parser, Piece
from kvscope.backend.server.tools import ToolCalling


@dataclass
class Answer:
    """One response in the making: its body, its model, its tools and the conversation it continues."""

    gen: Generation
    body: ResponsesBody
    model: str
    calling: ToolCalling
    conversation: list[ChatMessage]  # the stored history and this input, without the instructions
    store: ResponseStore  # where `store: true` keeps it


# ---- the response -----------------------------------------------------------------------------------------


def response_object(a: Answer, status: str, **fields: Any) -> dict[str, Any]:
    """The response as OpenAI writes it, with the request's settings echoed (`output` empty until it ends)."""
    body = a.body
    fmt = body.text.format if body.text and body.text.format else TextFormat(type="text")
    choice = body.tool_choice
    return {"id": a.gen.id, "object": "response", "created_at": a.gen.created, "status": status, "model": a.model,
            "output": [], "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tools": body.tools or [],
            "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "truncation": "disabled", "store": bool(body.store), "background": False,
            "previous_response_id": body.previous_response_id, "reasoning": None, "usage": None, "user": body.user,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "service_tier": body.service_tier or "default", **fields}


def read(parser: Parser | None, text: str, finished: bool) -> list[Piece]:
    """The answer's next text as pieces: content and calls (tool_parser.py), or the text itself without tools."""
    if parser is None:
        return [text] if text else []
    return parser.push(text) + (parser.finish() if finished else [])


def final_response(a: Answer, items: OutputItems) -> dict[str, Any]:
    """The finished response: `incomplete` when max_output_tokens cut the answer (finish reason "length"),
    `failed` when it was aborted (the server's time limit, a shutdown). Stored when the body asked."""
    gen = a.gen
    choice = gen.choices[0]
    if choice.finish_reason == "abort":
        why = "ran past the server's time limit" if gen.timed_out else "was aborted by the server"
        return failed(a, f"the request {why}")
    cut = choice.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    usage = gen.usage()
    output = items.output()
    if a.body.store:
        remember(a, output)
    return response_object(
        a, status, output=output,
        incomplete_details={"reason": "max_output_tokens"} if cut else None,
        completed_at=None if cut else gen.created,
        usage={"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
               "total_tokens": usage["total_tokens"],
               # no reasoning; no cache writes to count (the prefix cache keeps every full block anyway)
               "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                        "cache_write_tokens": 0},
               "output_tokens_details": {"reasoning_tokens": 0}})


def remember(a: Answer, output: list[dict[str, Any]]) -> None:
    """The conversation this response ends, for a later previous_response_id: its history, input and answer."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    answer = {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
    a.store.put(a.gen.id, [m.model_dump(exclude_none=True) for m in a.conversation] + [answer])


def failed(a: Answer, message: str, code: str = "server_error") -> dict[str, Any]:
    return response_object(a, "failed", error={"code": code, "message": message})


def answer_whole(a: Answer) -> dict[str, Any]:
    items = OutputItems(a.gen.id)
    choice = a.gen.choices[0]
    items.feed(read(a.calling.parser(), choice.text, True))
    items.finish(choice.finish_reason == "length")
    return final_response(a, items)


async def stream_events(a: Answer) -> AsyncIterator[ServerSentEventMessage]:
    """The response's events (the module's docstring); aborted if the client leaves."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> ServerSentEventMessage:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return ServerSentEventMessage(data=json.dumps(data), event=kind)

    items, parser = OutputItems(a.gen.id), a.calling.parser()
    try:
        yield event("response.created", response=response_object(a, "in_progress"))
        yield event("response.in_progress", response=response_object(a, "in_progress"))
        try:
            async for _, delta, token in a.gen.updates():
                for kind, fields in items.feed(read(parser, delta, token is None)):
                    yield event(kind, **fields)
        except RunFailed as e:
            yield event("response.failed", response=failed(a, run_failed(e).message))
            return
        except RequestFailed as e:  # its own fault: the error says which field, as the plain answer's 400 does
            error = request_failed(e)
            yield event("response.failed", response=failed(a, error.message, error.code))
            return
        if a.gen.choices[0].finish_reason == "abort":
            yield event("response.failed", response=final_response(a, items))
            return
        for kind, fields in items.finish(a.gen.choices[0].finish_reason == "length"):
            yield event(kind, **fields)
        final = final_response(a, items)
        yield event(f"response.{final['status']}", response=final)  # response.completed or response.incomplete
    finally:
        a.gen.close()  # a client that disconnected mid-stream lands here: its request is aborted


# ---- the route --------------------------------------------------------------------------------------------


@post("/responses", guards=[require_token], status_code=200)
async def create_response(request: Request, data: JSONBody[ResponsesBody]) -> Response:
    data.refuse_unimplemented()
    store: ResponseStore = request.app.state.manager.responses
    conversation = [*previous(store, data.previous_response_id), *data.input_messages()]  # a bad item: 400 here
    calling = data.tool_calling(conversation)
    grammar = data.grammar(calling)
    model = served_model(request, data.model)
    run = await api_run(request, model, 1)
    sampling = sampling_for(data, 0, grammar)
    messages, tools = calling.template_inputs(message_dicts([*data.instruction_messages(), *conversation]),
                                              reads_tools(run.loaded))
    try:
        prompt = await asyncio.to_thread(encode_chat, messages, run.loaded, tools)  # reads the model folder
    except ChatTemplateError as e:  # chat's handler would name `messages`: here the client sent `input`
        raise OpenAIError(400, str(e), "input") from None
    max_tokens = fit_in_context(run, len(prompt), data.max_output_tokens, DEFAULT_CHAT_MAX_TOKENS, "input",
                                "max_output_tokens")
    compiled = await compiled_grammar(request, run, grammar)  # off the run's worker, bounded in time
    gen = Generation(run, 1, "resp_", grammar=grammar)
    with named_by_source(grammar):
        await gen.submit([(prompt, max_tokens)], sampling, compiled)
    answer = Answer(gen, data, model, calling, conversation, store)
    return await respond(request, gen, stream_events(answer) if data.stream else None, lambda: answer_whole(answer))


def previous(store: ResponseStore, response_id: str | None) -> list[ChatMessage]:
    """The conversation a stored response ended; a 400 naming previous_response_id when none is kept."""
    if response_id is None:
        return []
    stored = store.get(response_id)
    if stored is None:
        raise OpenAIError(400, f"previous_response_id: no stored response {response_id[:64]!r}: kvscope keeps a "
                               f"response created with store: true for {store.ttl_s:g} s, within "
                               f"{store.max_bytes / 2**20:g} MB (--stored-response-ttl-s, --stored-responses-mb), "
                               "in this server's memory only", "previous_response_id")
    return [ChatMessage.model_validate(m) for m in stored]


responses_routes: list = [v1_router([create_response])]
