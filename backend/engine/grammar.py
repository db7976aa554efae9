"""Structured outputs: grammars compiled by xgrammar, one matcher per sequence, a token mask per row.

A request's `structured_outputs` (sampling_params.py) is compiled once against the model's
vocabulary (a JSON schema, any JSON object, a regex, a choice list or an EBNF grammar all become one
xgrammar grammar) and cached by its text, so a repeated request compiles nothing. The cache is
bounded in bytes, as xgrammar measures a compiled grammar (one can hold ~170 MB), not in entries;
`compiled` may run on any thread (xgrammar releases the GIL while it compiles), so a server compiles
a client's grammar on a thread of its own, with a time limit, and hands the engine the result. A
grammar that allows no token at its very start can never produce an output: it is refused. Each
sequence walks the grammar with its own `Matcher`: the scheduler's side asks it for a packed
bitmask of the tokens allowed next (one per verified position for a verify row), the executor
applies it before any other filter (sampler.constrain), and the update advances it with every
token appended. The model's EOS is the matcher's stop token: it is allowed exactly where the
grammar may end, and accepting it terminates the matcher.

xgrammar is imported where it is first used: it pulls in transformers (~0.7 s), which a run
without structured outputs never pays.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from kvscope.backend.engine.request import RequestError
from kvscope.backend.engine.sampling_params import StructuredOutputs, json_text
from kvscope.backend.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_BYTES = 256 * 2**20  # compiled grammars kept per engine, by xgrammar's own measure of each
MAX_REASON_CHARS = 200  # xgrammar's messages quote the whole input: a user's schema is not echoed back


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, inner: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self._inner, self.vocab_size = inner, vocab_size

    def fork(self) -> Matcher:
        """An independent copy at the same position (n > 1: each sibling walks on alone)."""
        return Matcher(self._inner.fork(), self.vocab_size)

    def accept(self, token: int) -> None:
        """Advance past a token the mask allowed (every appended token was drawn under this matcher's mask)."""
        accepted = self._inner.accept_token(token)
        assert accepted, f"token {token} was appended though the grammar forbids it"

    def allows_nothing(self) -> bool:
        """No token is allowed next, and the grammar has not ended: nothing can ever continue from here."""
        return not self.terminated and bool((self.masks([])[0] == 0).all())

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token, the model's EOS, was accepted)."""
        return self._inner.is_terminated()

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """Packed bitmasks int32 [len(drafts) + 1, ceil(V / 32)]: row j allows the tokens after drafts[:j].

        The drafts are walked tentatively and rolled back: only the verdict decides what is appended.
        Rows past a draft the grammar forbids (or past the end) allow everything: those positions are
        never reached, since the forbidden draft has probability 0 and is rejected."""
        masks = torch.full((len(drafts) + 1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        walked = 0
        for j in range(len(drafts) + 1):
            self._inner.fill_next_token_bitmask(masks, j)
            if j == len(drafts) or not self._inner.accept_token(drafts[j]):
                break
            walked += 1
            if self._inner.is_terminated():
                break
        if walked:
            self._inner.rollback(walked)
        return masks


class Grammars:
    """The grammars of one engine's model: a compiler over its vocabulary and the compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int],
                 max_bytes: int = MAX_CACHED_BYTES) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self.max_bytes = max_bytes
        self._compiled: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self.cached_bytes = 0  # of the grammars in the cache, as xgrammar counts them
        self.num_compiled = 0  # compilations done (a cache hit compiles nothing)
        self._lock = threading.Lock()  # the cache and the compiler: compiled() is called from any thread
        self._compiler_instance: xgrammar.GrammarCompiler | None = None

    def _compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        with self._lock:
            if self._compiler_instance is None:
                self._compiler_instance = xgrammar.GrammarCompiler(
                    tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids),
                    cache_enabled=False)  # our cache, keyed by the grammar's text and bounded in bytes, is the one
            return self._compiler_instance

    def matcher(self, spec: StructuredOutputs, compiled: xgrammar.CompiledGrammar | None = None) -> Matcher:
        """A new matcher at the start of the grammar: `compiled` (the caller compiled it), or compiled now,
        or found in the cache. RequestError naming the field if it does not compile, or allows nothing."""
        import xgrammar

        # Rollback is unlimited in xgrammar >= 0.2 (max_rollback_tokens is deprecated): a verify row walks
        # any number of drafts ahead.
        inner = xgrammar.GrammarMatcher(compiled or self.compiled(spec), terminate_without_stop_token=not self.eos_ids)
        matcher = Matcher(inner, self.vocab_size)
        if matcher.allows_nothing():
            raise RequestError(f"sampling.structured_outputs.{spec.kind}",
                               "allows no token at its start: no output can ever match it")
        return matcher

    def cached(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar | None:
        """The grammar if the cache holds it (then the most recently used), else None; compiles nothing.
        A server asks first, so that a repeated grammar takes none of its places for compiles."""
        key = (spec.kind, source_text(spec))
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        return None

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def compiled(self, spec: StructuredOutputs) -> xgrammar.CompiledGrammar:
        """The grammar compiled, or RequestError naming the field (its reason cut short: never the whole input).
        Any thread may call it; the compilation itself runs outside the lock."""
        hit = self.cached(spec)
        if hit is not None:
            return hit
        key = (spec.kind, source_text(spec))
        try:
            compiled = self._compile(*key)
        except (RuntimeError, ValueError) as e:
            raise RequestError(f"sampling.structured_outputs.{spec.kind}", short_reason(e)) from None
        with self._lock:
            self.num_compiled += 1
            self._keep(key, compiled)
        return compiled

    def _keep(self, key: tuple[str, str], compiled: xgrammar.CompiledGrammar) -> None:
        """Cache it, evicting the least recently used until the bytes fit; one larger than the whole budget
        is used by its request and not kept."""
        size = compiled.memory_size_bytes
        if key in self._compiled or size > self.max_bytes:
            return
        self._compiled[key] = compiled
        self.cached_bytes += size
        while self.cached_bytes > self.max_bytes:
            _, evicted = self._compiled.popitem(last=False)
            self.cached_bytes -= evicted.memory_size_bytes

    def _compile(self, kind: str, source: str) -> xgrammar.CompiledGrammar:
        compiler = self._compiler()
        if kind in ("json", "json_object"):
            # Compact JSON (no free whitespace between tokens): with it a small model can emit newlines
            # until max_tokens, a known failure of any-whitespace JSON grammars; the JSON is the same.
            return compiler.compile_json_schema(source, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(source)
        return compiler.compile_grammar(source)  # grammar, and choice as an EBNF alternation


def source_text(spec: StructuredOutputs) -> str:
    """The text the grammar compiles from (a choice list becomes an EBNF alternation of string literals)."""
    if spec.kind == "json":
        return spec.json if isinstance(spec.json, str) else json_text(spec.json)
    if spec.kind == "choice":
        return "root ::= " + " | ".join(json_text(choice) for choice in spec.choice)
    return '{"type":"object"}' if spec.kind == "json_object" else getattr(spec, spec.kind)


def short_reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location, cut before it quotes the input at length."""
    text = str(error).strip()
    if "] " in text and text.startswith("["):  # "[17:27:30] /project/cpp/x.cc:94: Regex parsing error ..."
        text = text.split("] ", 1)[1]
        text = text.split(": ", 1)[1] if text.startswith("/") else text
    text = text.split(" The JSON string is:")[0]
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of a byte-level BPE vocabulary (the demo models' and SmolLM2's), sized like the logits.

    Special tokens other than EOS are given no text: xgrammar treats an empty token as special and
    never allows it, where its literal text (`<|im_start|>`) would be allowed inside a JSON string."""
    import xgrammar

    encoded = [""] * vocab_size
    special = tokenizer.special_ids - set(eos_ids)
    for text, token in tokenizer.vocab().items():
        if token < vocab_size and token not in special:
            encoded[token] = text
    return xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                  stop_token_ids=list(eos_ids) or None)
