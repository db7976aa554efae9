"""The bridge between an API call and the engine's worker thread: the engine request behind one
OpenAI call (its n choices are the request's n sequences, sharing the prompt's blocks), their events
as they arrive, and text deltas that add up to the final text."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from backend.server.runs import EngineRun

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
WANTED_EVENTS = frozenset({"request_arrived", "seq_fork", "token", "request_finished"})


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
    stream: TextStream
    tokens: list[dict] = field(default_factory=list)  # token events, EOS left out
    chars: int = 0  # length of the token texts so far: the next token's text_offset
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None


class Generation:
    """The engine request behind one API call, and its events as they arrive."""

    def __init__(self, run: EngineRun, n: int, stops: list[str], prefix: str) -> None:
        self.run = run
        loaded = run.sim.loaded  # read-only: the tokenizer for text deltas, the folder for chat templates
        self.eos_ids = set(loaded.tokenizer.eos_token_ids)
        self.id = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.created = int(time.time())
        self.choices = [Choice(i, TextStream(loaded.tokenizer, stops)) for i in range(n)]
        self.choice_of_seq: dict[int, Choice] = {}  # the first sequence is choice 0, forks follow in order
        self.queue: asyncio.Queue[dict] = asyncio.Queue()

    async def submit(self, prompt: str | list[int], max_tokens: int, sampling: dict[str, Any]) -> None:
        """Add the request to the engine (RequestError if it refuses it)."""
        params = {**sampling, "n": len(self.choices)}  # each sibling draws from its own stream
        try:
            await asyncio.to_thread(self.run.add_request, prompt, max_tokens, params,
                                    self._listener(asyncio.get_running_loop()), self.id)
        except BaseException:
            self.close()
            raise

    def _listener(self, loop: asyncio.AbstractEventLoop):
        run, queue, rid = self.run, self.queue, self.id

        def deliver(event: dict) -> None:  # on the worker thread
            if event["type"] not in WANTED_EVENTS:
                return
            if event["type"] == "request_finished":
                run.forget_listener(rid)  # here, on the worker thread, no other thread races the dict
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:
                pass  # the event loop has closed: nobody is waiting for this request any more

        return deliver

    async def updates(self) -> AsyncIterator[tuple[Choice, str, dict | None]]:
        """(choice, new text, its token event) until every choice has finished; None: it finished."""
        while any(c.finish_reason is None for c in self.choices):
            event = await self.queue.get()
            if event["type"] == "request_arrived":
                self.choice_of_seq[event["seq_id"]] = self.choices[0]
                for choice in self.choices:
                    choice.prompt_tokens = len(event["prompt_token_ids"])
            elif event["type"] == "seq_fork":
                self.choice_of_seq[event["seq_id"]] = self.choices[len(self.choice_of_seq)]
            elif event["type"] == "token" and event["token_id"] not in self.eos_ids:
                choice = self.choice_of_seq[event["seq_id"]]
                choice.tokens.append(event)
                choice.chars += len(event["text"])
                yield choice, choice.stream.push(event["token_id"]), event
            elif event["type"] == "request_finished":
                for out in event.get("outputs") or [event]:
                    choice = self.choice_of_seq.get(out["seq_id"], self.choices[0])  # aborted before a fork
                    choice.text = out["output_text"]
                    choice.completion_tokens = len(out["output_token_ids"])
                    choice.finish_reason = FINISH_REASONS.get(out["finish_reason"], out["finish_reason"])
                    yield choice, choice.stream.finish(choice.text), None
                for choice in self.choices:  # aborted before it forked: the siblings never started
                    if choice.finish_reason is None:
                        choice.finish_reason = FINISH_REASONS.get(event["finish_reason"], event["finish_reason"])
                        yield choice, "", None

    async def wait(self) -> None:
        async for _ in self.updates():
            pass

    def close(self) -> None:
        """Abort the request if it still runs (the client went away); does not wait for the worker.

        A submission cancelled half-way may still reach the engine: the abort queues behind it."""
        if any(c.finish_reason is None for c in self.choices):
            asyncio.get_running_loop().run_in_executor(None, _abort, self.run, self.id)

    def usage(self) -> dict[str, int]:
        completion = sum(c.completion_tokens for c in self.choices)
        prompt = self.choices[0].prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _abort(run: EngineRun, request_id: str) -> None:
    try:
        run.abort_request(request_id)  # its request_finished event then drops the listener
    except Exception:  # noqa: BLE001 - a stopped run: nothing left to abort
        pass
