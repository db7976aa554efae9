"""Responses kept for `previous_response_id`: a response created with `store: true` is remembered as the
conversation it ended (its history, its input, its answer: message text and function calls), so that the
next request may send only what is new. The instructions are not kept: as OpenAI's, each response's own
`instructions` apply to it alone.

Bounded in memory: each conversation is counted by the size of its JSON, the oldest are forgotten first
to stay within `max_bytes`, and each expires `ttl_s` after it was stored. A conversation larger than the
whole budget is not kept. A lookup of one forgotten or never stored is None; the route says why.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Conversation = list[dict[str, Any]]  # chat messages as ChatMessage dumps them


@dataclass(frozen=True)
class Stored:
    messages: Conversation
    size: int  # bytes of its JSON
    expires: float


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()  # routes run on the event loop; `describe` may come from a thread

    def put(self, response_id: str, messages: Conversation) -> bool:
        """Keep a conversation under its response's id; False when it alone is larger than the budget."""
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if size > self.max_bytes:
            return False
        with self._lock:
            self._expire()
            while self._items and self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._items)))
            self._items[response_id] = Stored(messages, size, self.clock() + self.ttl_s)
            self._bytes += size
        return True

    def get(self, response_id: str) -> Conversation | None:
        with self._lock:
            self._expire()
            stored = self._items.get(response_id)
            return None if stored is None else stored.messages

    def describe(self) -> dict[str, Any]:
        with self._lock:
            self._expire()
            return {"stored_responses": len(self._items), "stored_response_bytes": self._bytes,
                    "max_stored_response_bytes": self.max_bytes, "stored_response_ttl_s": self.ttl_s}

    def _expire(self) -> None:
        now = self.clock()
        while self._items and next(iter(self._items.values())).expires <= now:  # stored in order: oldest first
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._items.pop(response_id).size
