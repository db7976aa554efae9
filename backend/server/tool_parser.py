"""Tool calls out of the model's text: Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
become OpenAI `tool_calls` entries; the text outside them stays the message's content.

One parser serves both answers: fed the whole text (a plain response) or its deltas as they arrive (a
stream), it produces the same content and the same calls, because a block is only judged when it
closes. A block whose JSON does not parse (or is not a call) stays content, as the model wrote it: a
call is never invented. Text that could be the start of `<tool_call>` is held back until the next
delta shows what it is, so a tag never leaks into the content half-written. Whitespace next to a call
(the newlines models put around blocks) is dropped; an unclosed block at the end is content.

With a call forced by a grammar (tool_choice "required" or a named function) the whole answer is the
call's JSON instead: ForcedCallParser reads it at the end.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
Piece = str | dict[str, Any]  # content text, or an OpenAI tool call


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call; ids are random, so that calls of different turns never share one (a seeded
    request repeated in an agent loop would otherwise answer two calls with the same id)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def loads(text: str) -> Any:
    """The JSON value of text, or None when it is not JSON (nesting past Python's recursion limit included:
    a model, or a client's history, can write a thousand brackets)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def call_of_block(inner: str) -> dict[str, Any] | None:
    """The call a block's text spells, or None when it is not {"name": str, "arguments": object}."""
    data = loads(inner)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return new_call(data["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    """One choice's text, in pieces, as content and calls; `max_calls` 1 without parallel_tool_calls
    (later calls are dropped, as vLLM drops them)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0
        self.buffer = ""  # text not yet judged
        self.in_block = False
        self.pending_space = ""  # whitespace after content: dropped if a call follows
        self.after_call = False  # whitespace right after a call is dropped

    def push(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The rest, at the end of the answer: an unclosed block is content, and so is trailing whitespace."""
        out: list[Piece] = []
        self._content(OPEN + self.buffer if self.in_block else self.buffer, out)
        self.buffer, self.in_block = "", False
        if self.pending_space:
            out.append(self.pending_space)
            self.pending_space = ""
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Judge what the buffer allows; True when something was consumed and another step may follow."""
        if self.in_block:
            end = self.buffer.find(CLOSE)
            if end < 0:
                return False
            self._block(self.buffer[:end], out)
            self.buffer, self.in_block = self.buffer[end + len(CLOSE):], False
            return True
        start = self.buffer.find(OPEN)
        if start >= 0:
            self._content(self.buffer[:start], out)
            self.buffer, self.in_block = self.buffer[start + len(OPEN):], True
            return True
        keep = _partial_tag(self.buffer)
        self._content(self.buffer[:len(self.buffer) - keep], out)
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _block(self, inner: str, out: list[Piece]) -> None:
        call = call_of_block(inner)
        if call is None:
            self._content(OPEN + inner + CLOSE, out)
            return
        self.pending_space, self.after_call = "", True
        if self.max_calls is None or self.calls < self.max_calls:
            out.append(call)
            self.calls += 1

    def _content(self, text: str, out: list[Piece]) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        text = self.pending_space + text
        body = text.rstrip()
        self.pending_space = text[len(body):]
        if body:
            out.append(body)


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>` (held back: the tag may follow)."""
    for size in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class ForcedCallParser:
    """The answer under a forced call: the arguments of `name` (a named tool_choice), or a JSON list of
    {"name", "arguments"} (tool_choice "required"). Read whole at the end; JSON that does not parse (an
    answer cut by max_tokens) is content."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.text = ""

    def push(self, text: str) -> list[Piece]:
        self.text += text
        return []

    def finish(self) -> list[Piece]:
        calls = self._calls()
        return calls if calls is not None else [self.text] if self.text else []

    def _calls(self) -> list[Piece] | None:
        data = loads(self.text)
        if self.name is not None:
            return [new_call(self.name, json.dumps(data, ensure_ascii=False))] if isinstance(data, dict) else None
        if not isinstance(data, list) or not data:
            return None
        calls = [call_of_block(json.dumps(item)) if isinstance(item, dict) else None for item in data]
        return None if None in calls else calls


def parse(parser: HermesToolParser | ForcedCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer: (content, or None when there is none; the calls)."""
    pieces = parser.push(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, dict)]


Parser = HermesToolParser | ForcedCallParser


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """"tool_calls" when the model stopped after making calls; a cut answer ("length") says it was cut."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_message(parser: Parser, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer as an assistant message with its tool calls, and its finish_reason."""
    content, calls = parse(parser, text)
    message = {"role": "assistant", "content": content, "refusal": None, **({"tool_calls": calls} if calls else {})}
    return message, finish_reason(reason, bool(calls))


class ToolCallStream:
    """One streamed choice's deltas with its calls in OpenAI's delta format: a call arrives whole in one
    delta when its block closes (index, id, type, name and the complete arguments)."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.calls = 0

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        pieces = self.parser.push(text) + (self.parser.finish() if finished else [])
        delta: dict[str, Any] = {}
        content = "".join(p for p in pieces if isinstance(p, str))
        if content:
            delta["content"] = content
        calls = [p for p in pieces if isinstance(p, dict)]
        if calls:
            delta["tool_calls"] = [{"index": self.calls + k, **call} for k, call in enumerate(calls)]
            self.calls += len(calls)
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.calls > 0)
