"""From an OpenAI body to engine requests, and the answer back to the client.

What every generating route (completions, chat, the Responses API) does around the engine: find the
model's API run (loading it on first use) and refuse a request its queue has no room for (429), check
the sampling fields as the engine will (a 400 naming the field, before anything runs), fit max_tokens
into the context, render chat messages for the template, and answer a submitted Generation, streamed
or whole, under the server's time limit and aborted when the client goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from litestar import MediaType, Request, Response
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from pydantic import BaseModel, ValidationError

from kvscope.backend.engine.request import check_prompt_ids
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.errors import validation_error
from kvscope.backend.server.api_run import ApiRun
from kvscope.backend.server.engine_run import EngineRun
from kvscope.backend.server.generation import Generation, prompt_logprobs
from kvscope.backend.server.openai_errors import OpenAIError, model_not_found
from kvscope.backend.server.openai_protocol import UNREADABLE_PARTS, ChatMessage, ContentPart
from kvscope.backend.server.structured import Grammar

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

DEFAULT_CHAT_MAX_TOKENS = 256  # OpenAI's is "the rest of the context"; the demo models stop long before
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos", "stop_token_ids", "logit_bias")


def served_model(request: Request, name: str | None) -> str:
    """The model a request names (the server's own when it names none); 404 for one not served."""
    manager = request.app.state.manager
    name = name or manager.default_model
    if name not in manager.api_models():
        raise model_not_found(name, manager.api_models())
    return name


async def api_run(request: Request, model: str, num_requests: int) -> ApiRun:
    """The API's run for `model` (the first call loads it); RunBusy if its queue cannot take num_requests."""
    run = await asyncio.to_thread(request.app.state.manager.api_run, model)
    run.check_room(num_requests)
    return run


def sampling_for(body: BaseModel, logprobs: int, grammar: Grammar | None = None) -> dict[str, Any]:
    """The engine's sampling dict, checked now so that a bad value is a 400 naming the field.

    A body without one of these fields (the Responses API has no `stop`, no `seed`) leaves it at its default."""
    sampling = {k: getattr(body, k) for k in SAMPLING_FIELDS if getattr(body, k, None) is not None}
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


async def compiled_grammar(request: Request, run: EngineRun, grammar: Grammar | None) -> CompiledGrammar | None:
    """The request's grammar compiled off the run's worker, within the server's time limit and places for
    compiles (grammar_compiles.py): RequestError naming the client's field, RunBusy (429), ClientGone."""
    if grammar is None:
        return None
    spec = SamplingParams.model_validate({"structured_outputs": grammar.outputs}).structured_outputs
    return await request.app.state.manager.compiles.compiled(run.grammars, spec, grammar.source,
                                                             lambda: client_gone(request))


def fit_in_context(run: ApiRun, prompt_len: int, asked: int | None, default: int, prompt_param: str,
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


def token_ids(run: ApiRun, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids; ids sent as such are checked against the vocabulary now, before an echo's
    forward pass reads them (RequestError naming `prompt`)."""
    if isinstance(prompt, str):
        return run.loaded.tokenizer.encode(prompt)
    check_prompt_ids(prompt, run.loaded.config.vocab_size)
    return prompt


async def set_echo(run: ApiRun, gen: Generation, prompts: list[str | list[int]], ids: list[list[int]],
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


# ---- the answer -------------------------------------------------------------------------------------------


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


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
