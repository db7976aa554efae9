"""A sequence's output text, decoded as its tokens come, and cut where a stop string appears.

The one place stop strings are handled. Each appended token (EOS aside) is decoded incrementally
(Tokenizer.decoder: a short window of recent tokens, so the whole output costs time linear in its
length, where decoding the whole text at every token cost O(n²)), and the new text is searched for
the stop strings. What comes back is the text now final: a stop string is not returned (as in
OpenAI's and vLLM's APIs), so the last `max(len(stop)) - 1` characters wait until later text shows
they do not start one. A stop string that appears must end in the newest text and begin after what
was already handed out, so the search looks only at the text not yet handed out.
"""

from __future__ import annotations

from collections.abc import Callable

from kvscope.backend.model.tokenizer import Tokenizer


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self._decode: Callable[[int], str] = tokenizer.decoder()
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1  # characters that may be the start of a stop string
        self.sent: list[str] = []  # the text handed out, chunk by chunk
        self.pending = ""  # decoded, not handed out yet
        self.stopped = False  # a stop string appeared: the text ends before it

    def push(self, token_id: int, stop_strings: bool = True) -> str:
        """Decode one more token; returns the text that is now final (possibly "").

        stop_strings False: the token ends the sequence anyway (one of its stop_token_ids), and its text
        is kept whole, stop strings or not."""
        assert not self.stopped, "nothing follows a stop string"
        self.pending += self._decode(token_id)
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1) if stop_strings else -1
        if cut >= 0:
            self.stopped = True
            return self._send(len(self.pending), cut)
        return self._send(max(0, len(self.pending) - self.hold))

    def _send(self, end: int, keep_until: int | None = None) -> str:
        """Hand out pending[:keep_until or end] and drop pending[:end]."""
        text = self.pending[:end if keep_until is None else keep_until]
        self.pending = self.pending[end:]
        if text:
            self.sent.append(text)
        return text

    def text(self) -> str:
        """The text before the stop string, once one appeared (what the sequence returns)."""
        assert self.stopped, "the whole output's text is Tokenizer.decode of its tokens"
        return "".join(self.sent)
