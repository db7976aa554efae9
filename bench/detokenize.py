"""Detokenization: the engine's incremental text against decoding the whole output at every token.

    python -m bench.detokenize [--model demo] [--lengths 128,512,2048,8192] [--stop]

A sequence's output text is decoded as its tokens come (backend/engine/detokenizer.py: tokenizers'
DecodeStream keeps a short window of recent tokens), so a token costs the same at any length and a
whole output costs time linear in its length. The way it was done before (the API's text deltas
decoded all of a choice's tokens at every new one) costs O(n) per token, O(n²) per output. Each row
times one output of n tokens (drawn from the model's vocabulary, seeded, specials left out) both
ways and checks that the texts agree; `--stop` adds two stop strings that never appear, so the
incremental side also searches for them (and holds back their length) at every token.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time

from bench.report import command_line, table
from kvscope.backend.engine.detokenizer import IncrementalText
from kvscope.backend.model.loader import load_model
from kvscope.backend.model.tokenizer import Tokenizer


def incremental(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    text = IncrementalText(tokenizer, stops)
    sent = "".join(text.push(t) for t in ids)
    seconds = time.perf_counter() - start
    return seconds, sent + text.pending


def whole_each_time(tokenizer: Tokenizer, ids: list[int]) -> tuple[float, str]:
    start = time.perf_counter()
    sent = ""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        end = len(text)
        while end > len(sent) and text[end - 1] == "\ufffd":  # an unfinished character waits
            end -= 1
        sent += text[len(sent):end]
    return time.perf_counter() - start, tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.detokenize", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--lengths", default="128,512,2048,8192")
    p.add_argument("--stop", action="store_true", help="search two stop strings at every token")
    args = p.parse_args(argv)
    tokenizer = load_model(args.model).tokenizer
    plain = [t for t in range(tokenizer.vocab_size) if t not in tokenizer.special_ids]
    stops = ["\x00never\x00", "NEVER-SEEN"] if args.stop else []
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        ids = random.Random(n).choices(plain, k=n)
        fast, text = incremental(tokenizer, ids, stops)
        slow, expected = whole_each_time(tokenizer, ids)
        rows.append([n, f"{fast / n * 1e6:.1f}", f"{slow / n * 1e6:.1f}", f"{slow / fast:.1f}x",
                     "yes" if text == expected else "NO"])
    print(f"`{command_line('bench.detokenize', sys.argv[1:] if argv is None else argv)}`, {datetime.date.today()}, model {args.model}"
          f"{', two stop strings searched' if stops else ''}\n")
    print(table(["output tokens", "incremental µs / token", "whole decode µs / token", "whole ÷ incremental",
                 "same text"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
