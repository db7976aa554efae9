"""Tool calls out of the model's text, as they are written: Hermes `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks (tool_choice "auto"), or the whole answer under a forced call (the arguments
of a named function, or a JSON list of calls for "required"), become OpenAI tool calls; the text outside
the blocks stays the message's content.

A parser is fed the answer's text in pieces (a stream) or whole (a plain response) and hands back
pieces of its own: content text, and for each call a `CallStart` (its id and name, once
`{"name": "...", "arguments": ` has been read), `CallArgs` (the arguments' text as the model writes
it, so that clients see them stream as vLLM streams them) and a `CallDone` when the arguments form a
JSON object. The same text gives the same pieces however it is split, so a stream and a plain answer
hold the same content and the same calls. A call that never completes (cut by max_tokens, or its JSON
broken) has no `CallDone`: a plain answer leaves it out, a stream has already sent what there was, and
neither ever turns it into content. A block that never shows a call's start stays content as the
model wrote it (a call is never invented), unless it closes holding a call in another key order.
Text that could be the start of `<tool_call>` is held back until the next piece shows what it is, so
a tag never leaks into the content half-written. Whitespace next to a call is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A call's start: its name, then the arguments object about to open (the order the forced grammar writes).
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256}?)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


@dataclass(frozen=True)
class CallDone:
    index: int


Piece = str | CallStart | CallArgs | CallDone  # content text, or a call's start, arguments or end


def new_call_id() -> str:
    """Ids are random, so that calls of different turns never share one (a seeded request repeated in an
    agent loop would otherwise answer two calls with the same id)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def loads(text: str) -> Any:
    """The JSON value of text, or None when it is not JSON (nesting past Python's recursion limit included:
    a model, or a client's history, can write a thousand brackets)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def call_of_block(inner: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) that a whole block spells, or None when it is not {"name": str,
    "arguments": object} (the arguments may be absent: none)."""
    data = loads(inner)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return data["name"], json.dumps(arguments, ensure_ascii=False)


class ObjectEnd:
    """Where a JSON object, fed piece by piece from its `{`, closes: brackets counted outside strings. A `<`
    outside a string ends it too, broken (no JSON has one there: it is a closing tag written too early)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape = 0, False, False

    def feed(self, text: str) -> tuple[int, bool] | None:
        """(index just past the end in text, whether the object closed) once it ended, else None."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
            elif ch == "<":
                return i, False
        return None


class CallScanner:
    """One call object as it is written: its start once the name is read, its arguments as they come, its end.
    `name` given (a forced named call): the text is the arguments object alone."""

    def __init__(self, index: int, name: str | None = None, emit: bool = True) -> None:
        self.index, self.emit = index, emit  # emit False: a call past the limit is read, never shown
        self.head = ""  # text before the arguments, until the start is known
        self.name = name
        self.args, self.end = "", ObjectEnd()
        self.args_done = False  # the arguments object closed
        self.done = False  # the call is whole (a named call: its arguments; otherwise the object's `}` too)
        self.broken = False
        if name is not None:
            self.id = new_call_id()

    @property
    def started(self) -> bool:
        return self.name is not None

    def start_pieces(self) -> list[Piece]:
        return [CallStart(self.index, self.id, self.name)] if self.emit else []

    def push(self, text: str) -> tuple[list[Piece], str | None]:
        """(pieces, the text after the call's end: None while it has not ended)."""
        out: list[Piece] = []
        if not self.started:
            self.head += text
            match = HEADER.match(self.head)
            if match is None:
                return out, None
            self.name, self.id = loads(f'"{match.group(1)}"') or match.group(1), new_call_id()
            out += self.start_pieces()
            text = self.head[match.end():]
        if not self.args_done:
            if not self.args:
                text = text.lstrip()  # before the arguments' `{`
            ended = self.end.feed(text)
            taken = text if ended is None else text[:ended[0]]
            self.args += taken
            if taken and self.emit:
                out.append(CallArgs(self.index, taken))
            if ended is None:
                return out, None
            text = text[ended[0]:]
            if not ended[1] or not isinstance(loads(self.args), dict):
                self.broken = True
                return out, text
            self.args_done = True
            if self.head == "":  # a named call: the arguments are the whole call
                return self._finish(out), text
        stripped = text.lstrip()
        if not stripped:
            return out, None
        if stripped[0] != "}":
            self.broken = True
            return out, stripped
        return self._finish(out), stripped[1:]

    def _finish(self, out: list[Piece]) -> list[Piece]:
        self.done = True
        return out + ([CallDone(self.index)] if self.emit else [])


def whole_call(index: int, name: str, arguments: str, emit: bool = True) -> list[Piece]:
    """A call read at once (a block whose start came in another order): start, arguments and end together."""
    if not emit:
        return []
    return [CallStart(index, new_call_id(), name), CallArgs(index, arguments), CallDone(index)]


class HermesToolParser:
    """One choice's text, in pieces, as content and calls; `max_calls` 1 without parallel_tool_calls
    (later calls are read and dropped, as vLLM drops them)."""

    forced = False

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls = 0  # calls begun, shown or dropped
        self.shown = 0
        self.buffer = ""  # text not yet judged
        self.in_block = False
        self.call: CallScanner | None = None  # inside a block whose call has started
        self.pending_space = ""  # whitespace after content: dropped if a call follows
        self.after_call = False  # whitespace right after a call is dropped

    def push(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The rest, at the end of the answer: a block whose call never started is content, as is trailing
        whitespace; a call that started ends there (complete or not)."""
        out: list[Piece] = []
        if self.call is None:
            self._content(OPEN + self.buffer if self.in_block else self.buffer, out)
        self.buffer, self.in_block, self.call = "", False, None
        if self.pending_space:
            out.append(self.pending_space)
            self.pending_space = ""
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Judge what the buffer allows; True when something was consumed and another step may follow."""
        if self.in_block:
            return self._in_block(out)
        start = self.buffer.find(OPEN)
        if start >= 0:
            self._content(self.buffer[:start], out)
            self.buffer, self.in_block = self.buffer[start + len(OPEN):], True
            return True
        keep = _partial_tag(self.buffer)
        self._content(self.buffer[:len(self.buffer) - keep], out)
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _in_block(self, out: list[Piece]) -> bool:
        if self.call is None:  # the call's start not read yet: a close tag first judges the block whole
            end = self.buffer.find(CLOSE)
            scanner = CallScanner(self.shown, emit=self._may_show())
            pieces, rest = scanner.push(self.buffer if end < 0 else self.buffer[:end])
            if scanner.started:
                self._begin_call(scanner.emit)
                self.call = scanner
                out += pieces
                self.buffer = (rest or "") + ("" if end < 0 else self.buffer[end:])
                return True
            if end < 0:
                return False
            self._whole_block(self.buffer[:end], out)
            self.buffer, self.in_block = self.buffer[end + len(CLOSE):], False
            return True
        if not (self.call.done or self.call.broken):
            pieces, rest = self.call.push(self.buffer)
            out += pieces
            self.buffer = rest or ""
            if rest is None:
                return False
        end = self.buffer.find(CLOSE)  # what follows the call inside its block is dropped, up to the tag
        if end < 0:
            return False
        self.buffer, self.in_block, self.call = self.buffer[end + len(CLOSE):], False, None
        return True

    def _may_show(self) -> bool:
        return self.max_calls is None or self.calls < self.max_calls

    def _begin_call(self, shown: bool) -> None:
        self.calls += 1
        self.shown += shown
        self.pending_space, self.after_call = "", True

    def _whole_block(self, inner: str, out: list[Piece]) -> None:
        call = call_of_block(inner)
        if call is None:
            self._content(OPEN + inner + CLOSE, out)
            return
        shown = self._may_show()
        out += whole_call(self.shown, *call, emit=shown)
        self._begin_call(shown)

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
    """The answer under a forced call, which the grammar makes JSON: the arguments of `name` (a named
    tool_choice), or a list of {"name", "arguments"} (tool_choice "required"). Streamed as it is written;
    a call the answer cut short never completes."""

    forced = True

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.scanner: CallScanner | None = CallScanner(0, name) if name is not None else None
        self.announced = False  # a named call: its start sent
        self.count = 0  # the list: calls read
        self.opened = self.closed = False  # the list's `[` and its end

    def push(self, text: str) -> list[Piece]:
        if self.name is None:
            return self._push_list(text)
        out: list[Piece] = [] if self.announced else self.scanner.start_pieces()
        self.announced = True
        if not (self.scanner.done or self.scanner.broken):
            out += self.scanner.push(text)[0]
        return out

    def finish(self) -> list[Piece]:
        return []

    def _push_list(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text and not self.closed:
            if self.scanner is not None:  # inside a call
                pieces, rest = self.scanner.push(text)
                out += pieces
                if rest is None:
                    break
                self.closed = self.scanner.broken
                self.scanner, text, self.count = None, rest, self.count + 1
                continue
            text = text.lstrip()
            if not text:
                break
            head, text = text[0], text[1:]
            if not self.opened:
                self.opened, self.closed = head == "[", head != "["
            elif head == "{":
                self.scanner = CallScanner(self.count)
                text = head + text
            elif head != ",":
                self.closed = True  # `]`, or anything the grammar would not have written
        return out


Parser = HermesToolParser | ForcedCallParser


def assemble(pieces: list[Piece]) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's (content, or None when there is none; its complete calls, as OpenAI's tool_calls)."""
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, dict[str, Any]] = {}
    done: set[int] = set()
    for p in pieces:
        if isinstance(p, CallStart):
            calls[p.index] = {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}}
        elif isinstance(p, CallArgs):
            calls[p.index]["function"]["arguments"] += p.text
        elif isinstance(p, CallDone):
            done.add(p.index)
    return content or None, [call for index, call in sorted(calls.items()) if index in done]


def parse(parser: Parser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer: (content, or None when there is none; the complete calls)."""
    return assemble(parser.push(text) + parser.finish())


def finish_reason(parser: Parser, reason: str | None, has_calls: bool) -> str | None:
    """"tool_calls" when the model chose to call (auto) and stopped after calls; a forced call reports the
    answer's own reason, "stop", as OpenAI and vLLM do; a cut answer ("length") says it was cut."""
    return "tool_calls" if has_calls and reason == "stop" and not parser.forced else reason


def chat_message(parser: Parser, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole answer as an assistant message with its tool calls, and its finish_reason."""
    content, calls = parse(parser, text)
    message = {"role": "assistant", "content": content, "refusal": None, **({"tool_calls": calls} if calls else {})}
    return message, finish_reason(parser, reason, bool(calls))


class ToolCallStream:
    """One streamed choice's deltas in OpenAI's delta format: a call's first entry has its index, id, type,
    name and empty arguments, the next ones its index and the arguments' next fragment."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.complete = 0

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        pieces = self.parser.push(text) + (self.parser.finish() if finished else [])
        delta: dict[str, Any] = {}
        content = "".join(p for p in pieces if isinstance(p, str))
        if content:
            delta["content"] = content
        entries: dict[int, dict[str, Any]] = {}  # one entry per call in a delta, its fragments joined
        for p in pieces:
            if isinstance(p, CallStart):
                entries[p.index] = {"index": p.index, "id": p.id, "type": "function",
                                    "function": {"name": p.name, "arguments": ""}}
            elif isinstance(p, CallArgs):
                entry = entries.setdefault(p.index, {"index": p.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += p.text
            elif isinstance(p, CallDone):
                self.complete += 1
        if entries:
            delta["tool_calls"] = list(entries.values())
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self.parser, reason, self.complete > 0)
