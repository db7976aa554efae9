"""OpenAI's response shapes for completions and chat: the whole answer, or its stream of chunks.

Built from a Generation (generation.py: the choices as the engine produced them), never from the
trace. A chat answer's text goes through the request's tool-call reader when it has tools
(tool_parser.py), so the same text becomes `content` or `tool_calls` in both shapes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from kvscope.backend.server.generation import GeneratedChoice, Generation
from kvscope.backend.server.openai_errors import request_failed, run_failed
from kvscope.backend.server.openai_protocol import StreamOptions
from kvscope.backend.server.run_errors import RequestFailed, RunFailed
from kvscope.backend.server.tool_parser import Parser, ToolCallStream, chat_message

NewParser = Callable[[], Parser | None]  # a reader of one choice's tool calls; None: plain content


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
            yield json.dumps(run_failed(e).body())
        except RequestFailed as e:  # the same for the request's own failure: no finish_reason, the error last
            yield json.dumps(request_failed(e).body())
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


def _chunk_choice(choice: GeneratedChoice, delta: str, token: dict | None, kind: str, logprobs: bool,
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
