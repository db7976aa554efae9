"""The bridge between an API call and the engine's worker thread: the engine requests behind one
OpenAI call (one per prompt; its n choices are the request's n sequences, sharing the prompt's
blocks), their outputs as they arrive (the engine's own stream, request_output.py: never the
trace, so every `events` level serves the same answers), and the logprobs of an echoed prompt.
The text comes as the engine made it final (`Token.text`: stop strings cut, a character split
across tokens whole), so the deltas a stream sends add up to the answer's text.

A request can fail only itself: when the engine ends one for a fault of its own (`Finished.error`: its
grammar allowed no token, its scores were not numbers), or its grammar let through an answer that is not
what the client asked for (grammar_answers.py), `updates` raises RequestFailed, which the routes answer
with OpenAI's error shape (a 400 naming the field, or the stream's last chunk); never `stop`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvscope.backend.engine.request_output import Arrived, Finished, Forked, RequestOutput, Token
from kvscope.backend.engine.sample_step import GRAMMAR_STRANDED
from kvscope.backend.model.attention import DenseCausalBackend
from kvscope.backend.model.loader import LoadedModel
from kvscope.backend.server.engine_run import EngineRun
from kvscope.backend.server.grammar_answers import answer_problem
from kvscope.backend.server.run_errors import RequestFailed, RunFailed
from kvscope.backend.server.structured import Grammar

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def own_failure(finished: Finished, grammar: Grammar | None) -> RequestFailed | None:
    """What the engine's error on a finished request means for the client (None: it did not fail)."""
    if finished.error is None:
        return None
    if grammar is not None and finished.error.startswith(GRAMMAR_STRANDED):
        return RequestFailed(finished.error, grammar.source, "grammar_allows_no_token")
    return RequestFailed(finished.error, None, "sampling_failed")


def wrong_answer(finished: Finished, grammar: Grammar | None) -> RequestFailed | None:
    """The first output that ended at its grammar's end (EOS) yet is not what the grammar's source asked for."""
    if grammar is None:
        return None
    for out in finished.outputs:
        problem = answer_problem(grammar.outputs, out["output_text"]) if out["finish_reason"] == "eos" else None
        if problem is not None:
            return RequestFailed(f"{problem}: the grammar compiled from it let this answer end, but cannot express "
                                 "all it asks for", grammar.source, "grammar_answer_invalid")
    return None


@dataclass
class GeneratedChoice:
    """One choice of an OpenAI answer (a prompt's sequence), as the engine's outputs build it."""

    index: int
    tokens: list[dict] = field(default_factory=list)  # token entries (text, logprob, top_logprobs), EOS left out
    chars: int = 0  # length of the echo and token texts so far: the next token's text_offset
    echo: str = ""  # the prompt, when the client asked for it back (echo)
    echo_tokens: list[dict] = field(default_factory=list)  # its token entries, with logprobs
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, those the prefix cache held
    completion_tokens: int = 0
    text: str = ""  # the deltas so far; the whole output text once finished
    finish_reason: str | None = None


class Generation:
    """The engine requests behind one API call (one per prompt, each with n sequences), and their events."""

    def __init__(self, run: EngineRun, n: int, prefix: str, num_prompts: int = 1,
                 grammar: Grammar | None = None) -> None:
        self.run = run
        self.grammar = grammar  # the answer's grammar, and the field that asked for it
        self.tokenizer = run.loaded.tokenizer  # read-only: each token's own text, for logprobs
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self.id = f"{prefix}{uuid.uuid4().hex[:16]}"  # prefix: "chatcmpl-", "cmpl-", "resp_" (OpenAI's)
        self.created = int(time.time())
        self.n = n
        # One prompt: the engine request is the response's id (the dashboard finds it by that name).
        self.request_ids = [self.id] if num_prompts == 1 else [f"{self.id}-{k}" for k in range(num_prompts)]
        self.prompt_of = {rid: k for k, rid in enumerate(self.request_ids)}
        # Prompt k's choices are k*n .. k*n+n-1, as OpenAI numbers a batch's choices.
        self.choices = [GeneratedChoice(i) for i in range(num_prompts * n)]
        # a request's first sequence is its first choice, forks follow
        self.choice_of_seq: dict[int, GeneratedChoice] = {}
        self.seqs_seen: dict[str, int] = {}
        self.queue: asyncio.Queue[RequestOutput | RunFailed] = asyncio.Queue()
        self.timed_out = False
        self._timer: asyncio.TimerHandle | None = None

    def choices_of(self, request_id: str) -> list[GeneratedChoice]:
        k = self.prompt_of[request_id]
        return self.choices[k * self.n:(k + 1) * self.n]

    async def submit(self, prompts: list[tuple[str | list[int], int]], sampling: dict[str, Any],
                     compiled: CompiledGrammar | None = None) -> None:
        """Add one request per (prompt, max_tokens) to the engine (RequestError if it refuses one); `compiled`:
        the grammar, compiled off the run's worker (grammar_compiles.py)."""
        params = {**sampling, "n": self.n}  # each sibling draws from its own stream
        loop = asyncio.get_running_loop()
        try:
            for rid, (prompt, max_tokens) in zip(self.request_ids, prompts):
                if isinstance(prompt, list):  # known now: a stream's usage so far has it from its first chunk
                    for choice in self.choices_of(rid):
                        choice.prompt_tokens = len(prompt)
                await asyncio.to_thread(self.run.add_request, prompt, max_tokens, params,
                                        self._listener(loop, rid), rid, compiled)
        except BaseException:
            self.close()
            raise

    def _listener(self, loop: asyncio.AbstractEventLoop, rid: str):
        queue = self.queue

        def deliver(output: RequestOutput | RunFailed) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:
                pass  # the event loop has closed: nobody is waiting for this request any more

        return deliver

    async def updates(self) -> AsyncIterator[tuple[GeneratedChoice, str, dict | None]]:
        """(choice, new text, its token entry) until every choice has finished; None: it finished.

        RunFailed if the run fails first; RequestFailed if the request does (its choices then count as
        finished: nothing is left to abort)."""
        while any(c.finish_reason is None for c in self.choices):
            output = await self.queue.get()
            if isinstance(output, RunFailed):
                raise output
            rid = output.request_id
            mine = self.choices_of(rid)
            if isinstance(output, Arrived):
                self.choice_of_seq[output.seq_id] = mine[0]
                self.seqs_seen[rid] = 1
                for choice in mine:
                    choice.prompt_tokens = output.num_prompt_tokens
            elif isinstance(output, Forked):
                self.choice_of_seq[output.seq_id] = mine[self.seqs_seen[rid]]
                self.seqs_seen[rid] += 1
            elif isinstance(output, Token) and output.token_id not in self.eos_ids:
                choice = self.choice_of_seq[output.seq_id]
                entry = self._entry(output)
                choice.tokens.append(entry)
                choice.chars += len(entry["text"])
                choice.text += output.text
                yield choice, output.text, entry
            elif isinstance(output, Finished):
                failed = own_failure(output, self.grammar)
                if failed is None and self.grammar is not None:  # off the event loop: a schema check takes ms
                    failed = await asyncio.to_thread(wrong_answer, output, self.grammar)
                if failed is not None:
                    for choice in mine:
                        choice.finish_reason = choice.finish_reason or "abort"
                    raise failed
                for choice in mine:
                    choice.cached_tokens = output.num_cached_prompt_tokens
                for out in output.outputs:
                    choice = self.choice_of_seq.get(out["seq_id"], mine[0])  # aborted before a fork
                    final = out["output_text"]
                    assert final.startswith(choice.text), "the engine's text deltas add up to the output text"
                    rest, choice.text = final[len(choice.text):], final  # a beam's text comes whole, at its end
                    choice.completion_tokens = len(out["output_token_ids"])
                    choice.finish_reason = FINISH_REASONS.get(out["finish_reason"], out["finish_reason"])
                    yield choice, rest, None
                for choice in mine:  # aborted before it forked: the siblings never started
                    if choice.finish_reason is None:
                        choice.finish_reason = FINISH_REASONS.get(output.finish_reason, output.finish_reason)
                        yield choice, "", None

    def _entry(self, token: Token) -> dict:
        """A token as the response shapes list it (openai_api.completion_logprobs, chat_logprobs)."""
        text = self.tokenizer.token_text
        entry = {"text": text(token.token_id), "logprob": token.logprob}
        if token.top_logprobs is not None:
            entry["top_logprobs"] = [[t, text(t), lp] for t, lp in token.top_logprobs]
        return entry

    def skip_generation(self, prompt_lengths: list[int]) -> None:
        """Echo with max_tokens 0: the choices end before any engine request is made."""
        for choice in self.choices:
            choice.prompt_tokens, choice.finish_reason = prompt_lengths[choice.index // self.n], "length"

    def limit_time(self, seconds: float) -> None:
        """Abort the requests still running after `seconds` (the server's time limit per request)."""
        self._timer = asyncio.get_running_loop().call_later(seconds, self._time_out)

    def _time_out(self) -> None:
        self.timed_out = True
        self.close()

    async def wait(self) -> None:
        async for _ in self.updates():
            pass

    def close(self) -> None:
        """Abort the requests that still run (the client went away); does not wait for the worker.

        A submission cancelled half-way may still reach the engine: the abort queues behind it."""
        if self._timer is not None and not self.timed_out:
            self._timer.cancel()
        for rid in self.request_ids:
            if any(c.finish_reason is None for c in self.choices_of(rid)):
                asyncio.get_running_loop().run_in_executor(None, _abort, self.run, rid)

    def usage(self) -> dict[str, Any]:
        """The tokens so far: a finished choice's as the engine counted them (EOS included), a running one's
        as streamed."""
        completion = sum(c.completion_tokens if c.finish_reason is not None else len(c.tokens) for c in self.choices)
        prompt = sum(c.prompt_tokens for c in self.choices[::self.n])  # each prompt once
        cached = sum(c.cached_tokens for c in self.choices[::self.n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


@torch.no_grad()
def prompt_logprobs(loaded: LoadedModel, ids: list[int], top: int) -> list[dict]:
    """Token entries for an echoed prompt: each token's logprob given those before it, its `top` likeliest
    alternatives (the first token has neither, as in OpenAI's answers). One forward pass, no KV cache:
    run it on the run's worker thread, between two engine steps."""
    model, tok = loaded.model, loaded.tokenizer
    hidden = model(torch.tensor(ids, device=model.device), torch.arange(len(ids), device=model.device),
                   DenseCausalBackend())
    logprobs = torch.log_softmax(model.logits(hidden[:-1]), dim=-1)  # [T-1, vocab]: row i predicts token i+1
    targets = torch.tensor(ids[1:], dtype=torch.long, device=model.device)[:, None]  # [T-1, 1]
    chosen = logprobs.gather(1, targets)[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    entries = [{"text": tok.token_text(ids[0]), "logprob": None, "top_logprobs": None}]
    for i, token in enumerate(ids[1:]):
        alternatives = [] if best is None else [[t, tok.token_text(t), lp] for t, lp in
                                                zip(best.indices[i].tolist(), best.values[i].tolist())]
        entries.append({"text": tok.token_text(token), "logprob": chosen[i], "top_logprobs": alternatives})
    return entries


def _abort(run: EngineRun, request_id: str) -> None:
    try:
        run.abort_request(request_id)  # its Finished output then drops the listener
    except Exception:  # noqa: BLE001 - a stopped run: nothing left to abort
        pass
