"""The Responses API's `output`, item by item: the answer's text as message items, its calls as
function_call items, built from the tool parser's pieces (tool_parser.py). A stream's events and a plain
response's `output` come from the same builder, so they hold the same items with the same ids.

    text      a message item opens (response.output_item.added, response.content_part.added), then one
              response.output_text.delta per piece; it closes (output_text.done, content_part.done,
              output_item.done) when a call starts or the answer ends
    a call    response.output_item.added (a function_call item, arguments ""), one
              response.function_call_arguments.delta per fragment, then .done and output_item.done
              once its arguments close as a JSON object

A call the answer cut short ends `incomplete` in the stream and is left out of `output`, as chat leaves it
out of `tool_calls`. An answer with neither text nor a call is one empty message, as OpenAI's is.
"""

from __future__ import annotations

from typing import Any

from kvscope.backend.server.tool_parser import CallArgs, CallDone, CallStart, Piece

Event = tuple[str, dict[str, Any]]  # (type, its fields)


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    def __init__(self, response_id: str) -> None:
        self.base = response_id.removeprefix("resp_")
        self.items: list[dict[str, Any]] = []  # in output order, as opened
        self.message: dict[str, Any] | None = None  # the message item open now
        self.text = ""  # its text so far
        self.calls: dict[int, dict[str, Any]] = {}  # a call's index -> its item
        self.done: set[int] = set()

    def feed(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for p in pieces:
            if isinstance(p, str):
                events += self._text(p)
            elif isinstance(p, CallStart):
                events += self._close_message("completed")
                item = {"id": "fc_" + p.id.removeprefix("call_"), "type": "function_call", "status": "in_progress",
                        "arguments": "", "call_id": p.id, "name": p.name}
                self.calls[p.index] = item
                events.append(self._added(item))
            elif isinstance(p, CallArgs):
                item = self.calls[p.index]
                item["arguments"] += p.text
                events.append(("response.function_call_arguments.delta", {**self._where(item), "delta": p.text}))
            elif isinstance(p, CallDone):
                self.done.add(p.index)
                events += self._close_call(self.calls[p.index], "completed")
        return events

    def finish(self, cut: bool) -> list[Event]:
        """Close what is open at the answer's end (`cut`: max_output_tokens ended it)."""
        events = [] if self.items else self._text("")
        events += self._close_message("incomplete" if cut else "completed")
        for index, item in self.calls.items():
            if index not in self.done and item["status"] == "in_progress":
                events += self._close_call(item, "incomplete")
        return events

    def output(self) -> list[dict[str, Any]]:
        """The response's `output`: every message, and the calls that completed."""
        return [dict(item) for item in self.items if item["type"] == "message" or item["status"] == "completed"]

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.message is None:
            k = sum(item["type"] == "message" for item in self.items)
            self.message = {"id": f"msg_{self.base}" + (f"_{k}" if k else ""), "type": "message",
                            "role": "assistant", "status": "in_progress", "content": []}
            self.text = ""
            events += [self._added(self.message),
                       ("response.content_part.added", {**self._where(self.message), "content_index": 0,
                                                        "part": text_part("")})]
        self.text += text
        if text:
            events.append(("response.output_text.delta", {**self._where(self.message), "content_index": 0,
                                                          "delta": text, "logprobs": []}))
        return events

    def _close_message(self, status: str) -> list[Event]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        part = text_part(self.text)
        message["content"], message["status"] = [part], status
        where = {**self._where(message), "content_index": 0}
        return [("response.output_text.done", {**where, "text": self.text, "logprobs": []}),
                ("response.content_part.done", {**where, "part": part}),
                ("response.output_item.done", {"output_index": self.items.index(message), "item": dict(message)})]

    def _close_call(self, item: dict[str, Any], status: str) -> list[Event]:
        item["status"] = status
        return [("response.function_call_arguments.done", {**self._where(item), "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": self.items.index(item), "item": dict(item)})]

    def _added(self, item: dict[str, Any]) -> Event:
        self.items.append(item)
        return "response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}
