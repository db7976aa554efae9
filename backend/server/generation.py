"""The bridge between an API call and the engine's worker thread: the n engine requests behind
one OpenAI call, their events as they arrive, and text deltas that add up to the final text."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from backend.server.runs import EngineRun

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
WANTED_EVENTS = frozenset({"request_arrived", "token", "request_finished"})


class TextStream:
    """Text deltas for one choice, so that they add up to exactly the final text.

    The final text drops a stop string and everything after it, so with stop strings the text
    waits: the newest token (the request may yet stop on it) and a tail that could still become
    the start of a stop string are held back until later tokens or the end show where the cut is.
    An unfinished UTF-8 character is held back too.
    """

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.wait_for_stop = bool(stops)
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        sure = self.ids[:-1] if self.wait_for_stop else self.ids
        text = self.tokenizer.decode(sure)  # whole-text decode: byte-level BPE splits characters
        end = len(text) - self.holdback
        while end > len(self.sent) and text[end - 1] == "\ufffd":
            end -= 1
        delta = text[len(self.sent):end]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta


@dataclass
class Choice:
    index: int
    request_id: str
    stream: TextStream
    tokens: list[dict] = field(default_factory=list)  # token events, EOS left out
    chars: int = 0  # length of the token texts so far: the next token's text_offset
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None


class Generation:
    """The n engine requests behind one API call, and their events as they arrive."""

    def __init__(self, run: EngineRun, n: int, stops: list[str], prefix: str) -> None:
        self.run = run
        loaded = run.sim.loaded  # read-only: the tokenizer for text deltas, the folder for chat templates
        self.eos_ids = set(loaded.tokenizer.eos_token_ids)
        self.id = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.created = int(time.time())
        self.choices = [Choice(i, f"{self.id}-{i}", TextStream(loaded.tokenizer, stops)) for i in range(n)]
        self.queue: asyncio.Queue[tuple[int, dict]] = asyncio.Queue()
        self.submitted = 0

    async def submit(self, prompt: str | list[int], max_tokens: int, sampling: dict[str, Any]) -> None:
        """Add the requests to the engine (RequestError if it refuses one: then none stays)."""
        loop = asyncio.get_running_loop()
        try:
            for choice in self.choices:
                params = dict(sampling)
                if "seed" in params:  # n samples from one seed must still differ
                    params["seed"] += choice.index
                await asyncio.to_thread(self.run.add_request, prompt, max_tokens, params,
                                        self._listener(loop, choice), choice.request_id)
                self.submitted += 1
        except BaseException:
            self.close()
            raise

    def _listener(self, loop: asyncio.AbstractEventLoop, choice: Choice):
        run, queue, rid = self.run, self.queue, choice.request_id

        def deliver(event: dict) -> None:  # on the worker thread
            if event["type"] not in WANTED_EVENTS:
                return
            if event["type"] == "request_finished":
                run.forget_listener(rid)  # here, on the worker thread, no other thread races the dict
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (choice.index, event))
            except RuntimeError:
                pass  # the event loop has closed: nobody is waiting for this request any more

        return deliver

    async def updates(self) -> AsyncIterator[tuple[Choice, str, dict | None]]:
        """(choice, new text, its token event) until every choice has finished; None: it finished."""
        while any(c.finish_reason is None for c in self.choices):
            index, event = await self.queue.get()
            choice = self.choices[index]
            if event["type"] == "request_arrived":
                choice.prompt_tokens = len(event["prompt_token_ids"])
            elif event["type"] == "token" and event["token_id"] not in self.eos_ids:
                choice.tokens.append(event)
                choice.chars += len(event["text"])
                yield choice, choice.stream.push(event["token_id"]), event
            elif event["type"] == "request_finished":
                choice.text = event["output_text"]
                choice.completion_tokens = len(event["output_token_ids"])
                choice.finish_reason = FINISH_REASONS.get(event["finish_reason"], event["finish_reason"])
                yield choice, choice.stream.finish(choice.text), None

    async def wait(self) -> None:
        async for _ in self.updates():
            pass

    def close(self) -> None:
        """Abort what is still running (the client went away); does not wait for the worker."""
        # +1: a submission cancelled half-way may still reach the engine, and its abort queues behind it.
        unfinished = [c.request_id for c in self.choices[:self.submitted + 1] if c.finish_reason is None]
        if unfinished:
            asyncio.get_running_loop().run_in_executor(None, _abort_all, self.run, unfinished)

    def usage(self) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in self.choices)
        prompt = self.choices[0].prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _abort_all(run: EngineRun, request_ids: list[str]) -> None:
    for rid in request_ids:
        try:
            run.abort_request(rid)  # its request_finished event then drops the listener
        except Exception:  # noqa: BLE001 - a stopped run: nothing left to abort
            pass
