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

This module holds the routes; their rooms (shared with the Responses route, responses_api.py):

    openai_protocol.py  the bodies (pydantic): what a client may send, bounded and refused by name
    openai_errors.py    every failure as OpenAI's error body, with its status
    openai_serving.py   from a body to engine requests (generation.py), and the answer back, whole or streamed
    openai_shapes.py    the completion and chat answers, and their stream's chunks
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from litestar import Request, Response, get, post
from litestar.params import FromPath, JSONBody

from kvscope.backend.model.chat import encode_chat, reads_tools
from kvscope.backend.server.generation import Generation
from kvscope.backend.server.guards import require_token  # off-loopback, the server token is the client's api_key
from kvscope.backend.server.openai_errors import OpenAIError, model_not_found, v1_router
from kvscope.backend.server.openai_protocol import MAX_CHOICES, ChatBody, CompletionBody, SamplingBody
from kvscope.backend.server.openai_serving import (DEFAULT_CHAT_MAX_TOKENS, api_run, compiled_grammar, fit_in_context,
                                                   message_dicts, respond, sampling_for, served_model, set_echo,
                                                   token_ids)
from kvscope.backend.server.openai_shapes import NewParser, chat_response, completion_response, stream_events
from kvscope.backend.server.structured import grammar_of, named_by_source
from kvscope.backend.server.tools import ToolCalling


def model_card(name: str, max_model_len: int) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's `root` and `max_model_len` (prompt plus answer, in tokens)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvscope", "root": name, "parent": None,
            "max_model_len": max_model_len}


@get("/models", sync_to_thread=True)  # looks for installed packages on disk
def list_models(request: Request) -> dict[str, Any]:
    manager = request.app.state.manager
    return {"object": "list", "data": [model_card(m, manager.api_config(m).max_model_len) for m in manager.api_models()]}


@get("/models/{model_id:path}", sync_to_thread=True)
def retrieve_model(request: Request, model_id: FromPath[str]) -> dict[str, Any]:
    served = request.app.state.manager.api_models()
    name = model_id.removeprefix("/")
    if name not in served:
        raise model_not_found(name, served)
    return model_card(name, request.app.state.manager.api_config(name).max_model_len)


@post("/completions", guards=[require_token], status_code=200)
async def completions(request: Request, data: JSONBody[CompletionBody]) -> Response:
    data.refuse_unimplemented()
    grammar = grammar_of(data)  # before any work: its size is checked
    if grammar is not None and data.max_tokens == 0:
        raise OpenAIError(400, f"{grammar.source}: max_tokens 0 generates nothing to constrain", grammar.source)
    model = served_model(request, data.model)
    prompts, n = data.prompts(), data.n or 1
    if len(prompts) * n > MAX_CHOICES:
        raise OpenAIError(400, f"n: {len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices", "n")
    run = await api_run(request, model, len(prompts))
    sampling = sampling_for(data, data.logprobs or 0, grammar)
    ids = await asyncio.to_thread(lambda: [token_ids(run, p) for p in prompts])
    if not all(ids):
        raise OpenAIError(400, "prompt: empty prompt", "prompt")
    max_tokens = [fit_in_context(run, len(i), data.max_tokens, 16, "prompt", "max_tokens") for i in ids]
    compiled = await compiled_grammar(request, run, grammar)  # off the run's worker, bounded in time
    gen = Generation(run, n, "cmpl-", len(prompts), grammar=grammar)
    if data.echo:
        await set_echo(run, gen, prompts, ids, data.logprobs)
    if data.max_tokens == 0:  # echo alone: scoring a text, nothing to generate
        gen.skip_generation([len(i) for i in ids])
    else:
        with named_by_source(grammar):
            await gen.submit(list(zip(prompts, max_tokens)), sampling, compiled)
    return await _respond(request, gen, data, model, "text", data.logprobs is not None, lambda: None)


@post("/chat/completions", guards=[require_token], status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatBody]) -> Response:
    data.refuse_unimplemented()
    calling = ToolCalling.of(data)
    grammar = calling.with_calls(grammar_of(data, calling.forced_schema()))  # before any work: sizes checked
    model = served_model(request, data.model)
    run = await api_run(request, model, 1)
    sampling = sampling_for(data, (data.top_logprobs or 0) if data.logprobs else 0, grammar)
    messages, tools = calling.template_inputs(message_dicts(data.messages), reads_tools(run.loaded))
    prompt = await asyncio.to_thread(encode_chat, messages, run.loaded, tools)  # reads the model folder
    prompt_len = len(prompt)
    asked = data.max_completion_tokens or data.max_tokens
    max_param = "max_completion_tokens" if data.max_completion_tokens else "max_tokens"
    max_tokens = fit_in_context(run, prompt_len, asked, DEFAULT_CHAT_MAX_TOKENS, "messages", max_param)
    compiled = await compiled_grammar(request, run, grammar)  # off the run's worker, bounded in time
    gen = Generation(run, data.n or 1, "chatcmpl-", grammar=grammar)
    with named_by_source(grammar):
        await gen.submit([(prompt, max_tokens)], sampling, compiled)
    return await _respond(request, gen, data, model, "chat", bool(data.logprobs), calling.parser)


async def _respond(request: Request, gen: Generation, body: SamplingBody, model: str, kind: Literal["text", "chat"],
                   logprobs: bool, new_parser: NewParser) -> Response:
    events = stream_events(gen, model, kind, logprobs, body.stream_options, new_parser) if body.stream else None
    return await respond(request, gen, events, lambda: completion_response(gen, model, logprobs) if kind == "text"
                         else chat_response(gen, model, logprobs, new_parser))


openai_routes: list = [v1_router([list_models, retrieve_model, completions, chat_completions])]
