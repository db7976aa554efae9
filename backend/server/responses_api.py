"""OpenAI's Responses API, `POST /v1/responses`: one answer to a conversation, as chat completions give,
in the newer shape the official clients' `responses.create/stream/parse` speak.

What it is, next to chat: the same request underneath (the conversation through the model's chat
template, one engine request, the same time limit, disconnect handling and grammar-constrained
sampling: openai_serving.respond, structured.py), written out differently:

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
              (or response.failed when the run failed, the time limit aborted it, or the request failed
              by its own fault: its grammar allowed no token; the error's `code` says which).

The body and its refusals are responses_protocol.py's; what a body becomes in the engine, and the
answer's time limit and disconnect handling, are openai_serving.py's, as for chat.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response.sse import ServerSentEventMessage

from kvscope.backend.model.chat import ChatTemplateError, encode_chat
from kvscope.backend.server.generation import Generation
from kvscope.backend.server.guards import require_token
from kvscope.backend.server.openai_errors import OpenAIError, request_failed, run_failed, v1_router
from kvscope.backend.server.openai_serving import (DEFAULT_CHAT_MAX_TOKENS, api_run, compiled_grammar, fit_in_context,
                                                   respond, sampling_for, served_model)
from kvscope.backend.server.responses_protocol import ResponsesBody, TextFormat
from kvscope.backend.server.run_errors import RequestFailed, RunFailed
from kvscope.backend.server.structured import named_by_source


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


def failed(gen: Generation, body: ResponsesBody, model: str, message: str,
           code: str = "server_error") -> dict[str, Any]:
    return response_object(gen, body, model, "failed", error={"code": code, "message": message})


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
        except RequestFailed as e:  # its own fault: the error says which field, as the plain answer's 400 does
            error = request_failed(e)
            yield event("response.failed", response=failed(gen, body, model, error.message, error.code))
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
    model = served_model(request, data.model)
    run = await api_run(request, model, 1)
    sampling = sampling_for(data, 0, grammar)
    try:
        prompt = await asyncio.to_thread(encode_chat, messages, run.loaded)  # reads the model folder
    except ChatTemplateError as e:  # chat's handler would name `messages`: here the client sent `input`
        raise OpenAIError(400, str(e), "input") from None
    max_tokens = fit_in_context(run, len(prompt), data.max_output_tokens, DEFAULT_CHAT_MAX_TOKENS, "input",
                                "max_output_tokens")
    compiled = await compiled_grammar(request, run, grammar)  # off the run's worker, bounded in time
    gen = Generation(run, 1, "resp", grammar=grammar)
    with named_by_source(grammar):
        await gen.submit([(prompt, max_tokens)], sampling, compiled)
    events = stream_events(gen, data, model) if data.stream else None
    return await respond(request, gen, events, lambda: final_response(gen, data, model))


responses_routes: list = [v1_router([create_response])]
