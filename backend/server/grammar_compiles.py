"""Clients' grammars compiled off the stepping thread: bounded in time and in how many at once, and
left behind when the client goes.

xgrammar compiles on its caller's thread (releasing the GIL) and cannot be interrupted: a 65 KB EBNF of
13,000 character classes, inside every bound structured.py sets, compiled for ~160 s on 2 cores. Compiled
inside admission on a run's worker it stalled the run: every other request waited, then got a 429. So the
server compiles each client's grammar (chat's, the Responses API's, a forced tool call's, a live request's)
on a thread of its own, into the run's own cache (`Engine.grammars`: bounded in bytes, any thread may
fill it), before it hands the request to the run (`Engine.add_request(grammar=...)`), and

- waits at most `--grammar-timeout-s`: past it the request is a 400 naming the field and the limit;
- compiles at most `--max-grammar-compiles` at once, server-wide: one more is a 429 with Retry-After,
  never a queue that grows;
- stops waiting when the client goes away.

A compile nobody waits for any more (timed out, or its client gone) runs on to its end, since xgrammar
cannot be stopped; it keeps its place until then, so that what abandoned compiles cost (CPU, and up to a
compiled grammar's size each, ~170 MB at most) is bounded by the number of places. Its result lands in
the run's cache, where a retry finds it. A grammar the cache holds takes no place and no thread.

Before a grammar is handed on, its start is checked here too, off the worker: one that allows no token
(the engine would refuse it on its worker), and a JSON grammar that allows only the end, whose only
answer would be the empty one, which is never JSON (xgrammar compiles a number range of [1e-300,
2e-300] so). A scenario's planned requests still compile on that run's worker: the run is its owner's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from kvscope.backend.engine.grammar import Grammars
from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import StructuredOutputs
from kvscope.backend.server.run_errors import RunBusy

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


class ClientGone(Exception):
    """The client went away while its grammar compiled: nobody waits for the answer."""


class GrammarCompiles:
    """The places for compiles (server-wide) and the time a request waits for one."""

    def __init__(self, max_at_once: Callable[[], int], timeout_s: Callable[[], float]) -> None:
        # read at each compile: `create_app(limits=...)` replaces the manager's limits after it is built
        self.max_at_once, self.timeout_s = max_at_once, timeout_s
        self.in_flight = 0  # compiles holding a place, waited for or not
        self._lock = threading.Lock()

    async def compiled(self, grammars: Grammars, spec: StructuredOutputs, field: str,
                       gone: Callable[[], Awaitable[object]] | None = None) -> CompiledGrammar:
        """The grammar compiled and its start checked, or RequestError naming `field` (it does not compile,
        allows nothing, or passed the time limit), RunBusy (every place taken), ClientGone (what `gone()`
        awaits, the client's leaving, came first)."""
        hit = grammars.cached(spec)
        if hit is not None:
            await asyncio.to_thread(check_start, grammars, spec, hit, field)  # a matcher: milliseconds
            return hit
        answer = self._start(grammars, spec, field)
        waits = {answer} | ({gone_task := asyncio.ensure_future(gone())} if gone is not None else set())
        try:
            done, _ = await asyncio.wait(waits, timeout=self.timeout_s(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone is not None:
                gone_task.cancel()
        if answer in done:
            return answer.result()
        answer.add_done_callback(_unobserved)
        if done:
            raise ClientGone
        timeout = self.timeout_s()
        raise RequestError(field, f"took longer than {timeout:g} s to compile (--grammar-timeout-s {timeout:g}); "
                                  "send a smaller grammar, or a schema without thousands of alternatives")

    def _start(self, grammars: Grammars, spec: StructuredOutputs, field: str) -> asyncio.Future:
        """Take a place (RunBusy if none is left) and compile on a daemon thread (it never holds up exit)."""
        most = self.max_at_once()
        with self._lock:
            if self.in_flight >= most:
                raise RunBusy(f"{self.in_flight} grammars are compiling, at most {most} at once "
                              "(--max-grammar-compiles); try again shortly")
            self.in_flight += 1
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        threading.Thread(target=self._compile, args=(grammars, spec, field, loop, answer), name="grammar-compile",
                         daemon=True).start()
        return answer

    def _compile(self, grammars: Grammars, spec: StructuredOutputs, field: str, loop: asyncio.AbstractEventLoop,
                 answer: asyncio.Future) -> None:
        try:
            compiled = grammars.compiled(spec)
            check_start(grammars, spec, compiled, field)
            outcome: tuple[Callable, object] = (answer.set_result, compiled)
        except Exception as e:  # noqa: BLE001 - handed to the waiting request, which answers it as a 4xx
            outcome = (answer.set_exception, named(e, field))
        finally:
            with self._lock:
                self.in_flight -= 1
        try:
            loop.call_soon_threadsafe(_settle, answer, *outcome)
        except RuntimeError:
            pass  # the event loop has closed: nobody is waiting


def _unobserved(answer: asyncio.Future) -> None:
    """A compile nobody waits for any more: its failure is read here, not logged as never retrieved."""
    if not answer.cancelled():
        answer.exception()


def _settle(answer: asyncio.Future, settle: Callable, value: object) -> None:
    if not answer.done():  # the waiter may have given up and gone
        settle(value)


def named(error: Exception, field: str) -> Exception:
    """The engine names a grammar `sampling.structured_outputs.<kind>`: the client sent `field`."""
    if isinstance(error, RequestError) and (error.field or "").startswith("sampling.structured_outputs"):
        return RequestError(field, error.reason)
    return error


def check_start(grammars: Grammars, spec: StructuredOutputs, compiled: CompiledGrammar, field: str) -> None:
    """RequestError naming `field` for a grammar no answer can come from: it allows no token at its start
    (Grammars.matcher says so), or, for JSON, only the end: the empty answer, never JSON."""
    try:
        matcher = grammars.matcher(spec, compiled)
    except RequestError as e:
        raise named(e, field) from None
    if spec.kind in ("json", "json_object") and only_the_end(matcher.masks([])[0], grammars.eos_ids):
        raise RequestError(field, "allows only an empty answer, which is not JSON: the grammar compiled from this "
                                  "schema holds constraints it cannot express (a number range too narrow for "
                                  "the numbers JSON writes, say)")


def only_the_end(mask: torch.Tensor, eos_ids: list[int]) -> bool:
    """Whether a packed bitmask [ceil(V / 32)] allows nothing but the end-of-text tokens."""
    ends = torch.zeros_like(mask)
    for token in eos_ids:
        ends[token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)
    return bool(((mask & ~ends) == 0).all())
