"""Speculative decoding benchmark: measured speedup against the textbook prediction, k = 1..8.

    python -m bench.spec_decode [--method draft|ngram] [--ks 1-8] [--requests 2] [--max-tokens 128]
                                [--temperature 1.0] [--repeat 3] [--json OUT.json]

The same requests (prompts drawn, seeded, from the validation split of the corpus, so acceptance is
what real text gives; `ignore_eos` so every run generates the same number of tokens; the same
per-request seeds) are served by the plain engine and by the speculative engine at each k, all
arriving at once: 1-4 concurrent requests is the realistic mix, since speculation buys latency.

For each k:
- alpha, the expected acceptance E[sum_x min(p(x), q(x))] over the positions the target judged, and
  the acceptance rate and mean tokens per verify, from the engine's own `spec_stats`;
- c, the cost ratio: the mean draft forward (its one- or two-token steps, not the first catch-up
  on the prompt) over the mean plain decode forward of the target, both on a batch of `--requests`
  rows, timed in this run by wrapping the two runners' `execute`. The n-gram proposer has no model:
  its c is the time of one `propose` call per drafted round over the same decode forward;
- the prediction of Leviathan et al. (2023), (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)): expected
  tokens per verify over the cost of one verify iteration in plain decode steps, which assumes that
  verifying k + 1 tokens costs one decode forward and that nothing but forwards takes time;
- the measured speedup: wall time of the plain run over that of the speculative run. Runs are
  interleaved (plain, k=1, plain, k=2, ..., plain) and repeated; each speculative run is compared
  with the mean of the plain runs just before and after it, and the median over repeats is kept,
  so slow drift and one-off stalls of this shared machine cancel. Everything is warmed up first.

A second table breaks one iteration down (mean milliseconds over the iterations that were pure
decode steps or pure verify steps): draft forwards, the rest of the proposer (draft sampling,
bookkeeping), the target's forward, and everything else the engine does in a step. It shows where
the prediction's assumptions fail when the measured speedup falls short of it.

Target: at the best k (highest measured speedup), measured >= 90% of the prediction.

Events are off by default (`--events full` adds what a watched run pays for its events, a little
more per verify than per decode). On a shared 2-core machine run it with OMP_NUM_THREADS=1: two
threads contending with another process make single forwards stall for milliseconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, load_model
from kvscope.backend.scenario import draw_prompt
from bench.report import command_line, progress, table

TARGET_FRACTION = 0.9
BLOCK_SIZE = 16
DEVICE = "cpu"


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams


# ---- timing what a run spends its time on ---------------------------------------------------------


@dataclass
class Probe:
    """Wraps an engine's executor, its draft runner and its step; records seconds per call."""

    target: list[tuple[str, int, float]] = field(default_factory=list)  # (kind, batch rows, seconds)
    draft: list[tuple[str, int, float]] = field(default_factory=list)  # (kind, batch rows, seconds)
    propose: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, rounds wanted, seconds)
    steps: list[dict] = field(default_factory=list)  # per iteration: kind and seconds by part

    def attach(self, engine: Engine) -> None:
        executor = engine.executor
        executor.execute = self._timed(executor.execute, self.target, target_kind)
        runner = getattr(executor.proposer, "runner", None)
        if runner is not None:
            runner.logits = self._timed(runner.logits, self.draft, draft_kind)  # the proposer samples itself
        if executor.proposer is not None:
            executor.propose = self._timed_propose(executor.propose)
        engine.step = self._timed_step(engine.step)

    @staticmethod
    def _timed(execute: Callable, out: list, kind: Callable) -> Callable:
        def wrapper(inp):
            start = time.perf_counter()
            logits = execute(inp)
            out.append((kind(inp), inp.num_rows, time.perf_counter() - start))
            return logits
        return wrapper

    def _timed_propose(self, propose: Callable) -> Callable:
        def wrapper(inp):
            start = time.perf_counter()
            proposals = propose(inp)
            rounds = max((r.num_drafts for r in inp.rows), default=0)
            self.propose.append((len(inp.rows), rounds, time.perf_counter() - start))
            return proposals
        return wrapper

    def _timed_step(self, step: Callable) -> Callable:
        def wrapper():
            marks = len(self.target), len(self.draft), len(self.propose)
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            target, draft = self.target[marks[0]:], self.draft[marks[1]:]
            kinds = {k for k, _, _ in target}
            self.steps.append({"kind": kinds.pop() if len(kinds) == 1 else "mixed", "seconds": seconds,
                               "target_s": sum(s for _, _, s in target), "draft_s": sum(s for _, _, s in draft),
                               "propose_s": sum(s for _, _, s in self.propose[marks[2]:])})
        return wrapper


def target_kind(inp) -> str:
    """decode (every row one new token), verify (every row verifies drafts), else prefill."""
    phases = set(inp.phases)
    return phases.pop() if len(phases) == 1 and phases <= {"decode", "verify"} else "prefill"


def draft_kind(inp) -> str:
    """step: one drafted token per row (the first round also catches up on one or two accepted
    tokens); catch_up: the draft reads a prompt it has not seen."""
    return "step" if all(inp.num_query(i) <= 2 for i in range(inp.num_rows)) else "catch_up"


def median_at(runs: list["TimedRun"], records: Callable[["TimedRun"], list], kind: str, rows: int) -> float:
    """Median seconds of the calls of this kind on a batch of `rows` (any batch size when none had it),
    pooled over the runs: a median, because a stall of this shared machine lands in single calls."""
    calls = [c for r in runs for c in records(r) if c[0] == kind]
    same = [s for _, b, s in calls if b == rows] or [s for _, _, s in calls]
    return statistics.median(same)


# ---- one run --------------------------------------------------------------------------------------


@dataclass
class TimedRun:
    """One engine run of the benchmark, timed: its wall time, steps, outputs and per-step probe."""

    seconds: float
    steps: int
    output_tokens: int
    spec: dict[str, float]  # spec_stats.summary(); empty for plain decoding
    probe: Probe = field(repr=False)
    outputs: dict[str, list[int]] = field(repr=False, default_factory=dict)

    def step_breakdown(self, kind: str) -> dict[str, float] | None:
        """Mean ms per iteration of this kind (decode or verify), split into its parts."""
        steps = [s for s in self.probe.steps if s["kind"] == kind]
        if not steps:
            return None
        mean = {key: 1000 * statistics.fmean(s[key] for s in steps) for key in ("seconds", "target_s", "draft_s",
                                                                                 "propose_s")}
        return {"iterations": len(steps), "step_ms": mean["seconds"], "draft_forward_ms": mean["draft_s"],
                "proposer_other_ms": mean["propose_s"] - mean["draft_s"], "target_forward_ms": mean["target_s"],
                "engine_other_ms": mean["seconds"] - mean["propose_s"] - mean["target_s"]}


def engine_config(spec: dict | None, requests: list[BenchRequest], max_tokens: int, events: str) -> EngineConfig:
    longest = max(len(r.prompt) for r in requests) + max_tokens + 16
    per_seq = math.ceil(longest / BLOCK_SIZE) + 1
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=2 * per_seq * len(requests) + 8,
                        max_num_seqs=len(requests), max_num_batched_tokens=max(256, longest * len(requests)),
                        max_model_len=longest + 16, events=events, speculative=spec, device=DEVICE)


def run_once(target: LoadedModel, draft: LoadedModel | None, config: EngineConfig, requests: list[BenchRequest],
             max_tokens: int) -> TimedRun:
    engine = Engine(target, config, EventBus(level=config.events), draft=draft)
    probe = Probe()
    probe.attach(engine)
    for r in requests:
        engine.add_request(r.request_id, r.prompt, max_tokens, r.sampling)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    outputs = {rid: req.seq.output_token_ids for rid, req in engine.requests.items()}
    stats = engine.spec_stats
    spec = stats.summary() | {"drafts_per_verify": stats.num_proposed / max(1, stats.num_verifies)}
    return TimedRun(seconds, engine.step_no, sum(map(len, outputs.values())),
                    spec if engine.executor.proposer else {}, probe, outputs)


# ---- the sweep ------------------------------------------------------------------------------------


def make_requests(target: LoadedModel, count: int, prompt_tokens: int, temperature: float,
                  seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(f"s{i}", draw_prompt(target.tokenizer, prompt_tokens, rng),
                         SamplingParams(temperature=temperature, seed=1000 + i, ignore_eos=True))
            for i in range(count)]


def spec_config(method: str, draft_model: str, k: int) -> dict:
    return {"method": method, "num_tokens": k} | ({"draft_model": draft_model} if method == "draft" else {})


def sweep(target: LoadedModel, draft: LoadedModel | None, args: argparse.Namespace,
          requests: list[BenchRequest]) -> tuple[list[TimedRun], dict[int, list[TimedRun]]]:
    """Plain, k1, plain, k2, ..., plain; `repeat` rounds after one untimed warm-up round."""
    plain_config = engine_config(None, requests, args.max_tokens, args.events)
    spec_configs = {k: engine_config(spec_config(args.method, args.draft_model, k), requests, args.max_tokens,
                                     args.events) for k in args.ks}
    for config in [plain_config, *spec_configs.values()]:
        run_once(target, draft, config, requests, args.max_tokens)
    plains: list[TimedRun] = []
    specs: dict[int, list[TimedRun]] = {k: [] for k in args.ks}
    for round_ in range(args.repeat):
        progress(f"round {round_ + 1}/{args.repeat}")
        plains.append(run_once(target, draft, plain_config, requests, args.max_tokens))
        for k, config in spec_configs.items():
            specs[k].append(run_once(target, draft, config, requests, args.max_tokens))
            plains.append(run_once(target, draft, plain_config, requests, args.max_tokens))
    expected = args.max_tokens * len(requests)
    wrong = [run.output_tokens for run in [*plains, *(r for runs in specs.values() for r in runs)]
             if run.output_tokens != expected]
    if wrong:
        raise RuntimeError(f"runs generated {wrong} tokens, not {expected}: the speedups would compare unequal work")
    return plains, specs


def speedups(plains: list[TimedRun], runs: list[TimedRun], index: int, num_ks: int) -> list[float]:
    """Each round's plain-over-speculative ratio, the plain time being the runs just before and after."""
    out = []
    for round_, run in enumerate(runs):
        before = plains[round_ * (num_ks + 1) + index]
        after = plains[round_ * (num_ks + 1) + index + 1]
        out.append((before.seconds + after.seconds) / 2 / run.seconds)
    return out


def predicted(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. (2023), eq. (1) over the cost of an iteration: E[tokens per verify] / (k c + 1)."""
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


def cost_ratio(method: str, runs: list[TimedRun], plain_decode_s: float, rows: int) -> float:
    """c: one draft step over one plain target decode forward (see the module docstring)."""
    if method == "draft":
        draft_step = median_at(runs, lambda r: r.probe.draft, "step", rows)
    else:
        per_round = [s / max(1, rounds) for r in runs for n, rounds, s in r.probe.propose if n == rows]
        per_round = per_round or [s / max(1, rounds) for r in runs for _, rounds, s in r.probe.propose]
        draft_step = statistics.median(per_round)
    return draft_step / plain_decode_s


def summarize(args: argparse.Namespace, plains: list[TimedRun],
              specs: dict[int, list[TimedRun]]) -> tuple[list[dict], dict]:
    rows_per_batch = args.requests
    plain_decode_s = median_at(plains, lambda r: r.probe.target, "decode", rows_per_batch)
    reference = plains[0].outputs
    table_rows = []
    for index, (k, runs) in enumerate(specs.items()):
        stats = runs[0].spec  # seeded: identical in every round
        alpha = stats["spec_alpha"]
        c = cost_ratio(args.method, runs, plain_decode_s, rows_per_batch)
        ratios = speedups(plains, runs, index, len(specs))
        verify_s = median_at(runs, lambda r: r.probe.target, "verify", rows_per_batch)
        measured, prediction = statistics.median(ratios), predicted(alpha, k, c)
        table_rows.append({
            "k": k, "alpha": alpha, "acceptance_rate": stats["spec_acceptance_rate"],
            "tokens_per_verify": stats["spec_tokens_per_verify"], "drafts_per_verify": stats["drafts_per_verify"],
            "c": c, "predicted": prediction,
            "measured": measured, "measured_over_predicted": measured / prediction, "speedups": ratios,
            "verify_over_decode": verify_s / plain_decode_s,
            "same_outputs": sum(reference[rid] == out for rid, out in runs[0].outputs.items())
            if args.temperature == 0 else None,
            "breakdown": median_breakdown(runs, "verify"), "steps": runs[0].steps})
    plain = {"decode_forward_ms": 1000 * plain_decode_s, "breakdown": median_breakdown(plains, "decode"),
             "steps": plains[0].steps, "seconds": [r.seconds for r in plains]}
    for r in table_rows:
        r["from_iterations"] = from_iterations(r, plain)
    return table_rows, plain


def from_iterations(row: dict, plain: dict) -> float | None:
    """The speedup the measured iteration times imply: tokens per verify x plain ms / verify ms.

    The prediction's own structure with its cost assumptions replaced by measurements: where it is
    close to the measured speedup, the breakdown accounts for the gap to the prediction."""
    if row["breakdown"] is None or plain["breakdown"] is None:
        return None
    return row["tokens_per_verify"] * plain["breakdown"]["step_ms"] / row["breakdown"]["step_ms"]


def median_breakdown(runs: list[TimedRun], kind: str) -> dict[str, float] | None:
    parts = [b for r in runs if (b := r.step_breakdown(kind))]
    if not parts:
        return None
    return {key: statistics.median(p[key] for p in parts) for key in parts[0]}


def verdict(rows: list[dict]) -> dict:
    best = max(rows, key=lambda r: r["measured"])
    return {"best_k": best["k"], "measured": best["measured"], "predicted": best["predicted"],
            "fraction": best["measured_over_predicted"], "target": TARGET_FRACTION,
            "met": best["measured_over_predicted"] >= TARGET_FRACTION}


# ---- printing -------------------------------------------------------------------------------------


SPEEDUP_HEADERS = ["k", "α", "acceptance rate", "drafts / verify", "tokens / verify", "c", "predicted", "measured",
                   "measured / predicted"]
BREAKDOWN_HEADERS = ["run", "iterations", "ms / iteration", "draft forwards", "proposer other", "target forward",
                     "engine other", "verify / decode forward", "speedup from iteration times"]


def print_report(meta: dict, rows: list[dict], plain: dict, v: dict) -> None:
    print(f"## Speculative decoding benchmark ({meta['method']})\n")
    print(f"- command: `{meta['command']}`")
    print(f"- date: {meta['date']}; torch {meta['torch']}, {meta['torch_threads']} threads, {meta['machine']}")
    proposer = f"draft {meta['draft_model']}" if meta["method"] == "draft" else "n-gram prompt lookup"
    print(f"- target {meta['model']}, {proposer}; {meta['requests']} concurrent request(s), prompts of "
          f"{meta['prompt_tokens']} validation tokens, {meta['max_tokens']} output tokens each (ignore_eos), "
          f"temperature {meta['temperature']:g}, events {meta['events']}")
    print(f"- plain decode forward (batch {meta['requests']}): {plain['decode_forward_ms']:.2f} ms; "
          f"speedup = median over {meta['repeat']} interleaved rounds of plain / speculative wall time\n")
    same = rows[0]["same_outputs"] is not None
    headers = SPEEDUP_HEADERS + (["outputs = plain"] if same else [])
    print(table(headers, [[r["k"], f"{r['alpha']:.3f}", f"{r['acceptance_rate']:.3f}",
                           f"{r['drafts_per_verify']:.2f}", f"{r['tokens_per_verify']:.2f}", f"{r['c']:.3f}",
                           f"{r['predicted']:.2f}x", f"{r['measured']:.2f}x",
                           f"{100 * r['measured_over_predicted']:.0f}%"]
                          + ([f"{r['same_outputs']}/{meta['requests']}"] if same else []) for r in rows]))
    print("\npredicted = (1 - α^(k+1)) / ((1 - α)(k·c + 1)); c = draft step / target decode forward, "
          "same batch size\n")
    print("Mean ms per iteration (pure decode iterations for plain, pure verify iterations for k):\n")
    print(table(BREAKDOWN_HEADERS, [breakdown_row("plain", plain["breakdown"], 1.0, None)]
                + [breakdown_row(f"k={r['k']}", r["breakdown"], r["verify_over_decode"], r["from_iterations"])
                   for r in rows]))
    print(f"\n{'PASS' if v['met'] else 'FAIL'}: at the best k ({v['best_k']}) measured {v['measured']:.2f}x is "
          f"{100 * v['fraction']:.0f}% of the predicted {v['predicted']:.2f}x (target >= "
          f"{100 * TARGET_FRACTION:.0f}%)\n")


def breakdown_row(name: str, b: dict | None, verify_ratio: float, implied: float | None) -> list:
    if b is None:
        return [name, 0, "-", "-", "-", "-", "-", "-", "-"]
    return [name, f"{b['iterations']:.0f}", f"{b['step_ms']:.2f}", f"{b['draft_forward_ms']:.2f}",
            f"{b['proposer_other_ms']:.2f}", f"{b['target_forward_ms']:.2f}", f"{b['engine_other_ms']:.2f}",
            f"{verify_ratio:.2f}", "-" if implied is None else f"{implied:.2f}x"]


# ---- main -----------------------------------------------------------------------------------------


def parse_ks(text: str) -> list[int]:
    """'1-8', '1,2,4' or '3' -> sorted distinct ks."""
    ks: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        ks.update(range(int(low), int(high or low) + 1))
    return sorted(ks)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("draft", "ngram"), default="draft", help="the proposer (default: draft)")
    p.add_argument("--ks", default="1-8", help="drafted tokens per verify to sweep: 1-8, 1,2,4 (default 1-8)")
    p.add_argument("--requests", type=int, default=2, help="concurrent requests (default 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per request (default 64)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="1.0 (default): sampled, accepted by rejection sampling; 0: greedy, outputs checked "
                        "against plain decoding")
    p.add_argument("--repeat", type=int, default=3, help="interleaved timed rounds (default 3)")
    p.add_argument("--events", choices=("full", "summary", "off"), default="off",
                   help="event level of every run (default off: the decoding itself)")
    p.add_argument("--model", default="demo", help="target model (default: demo)")
    p.add_argument("--draft-model", default="demo-draft", help="draft model (default: demo-draft)")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write every number to this file")
    args = p.parse_args(argv)
    try:
        args.ks = parse_ks(args.ks)
    except ValueError:
        p.error(f"--ks {args.ks!r}: expected numbers and ranges like 1-8 or 1,2,4")
    if not args.ks or not all(1 <= k <= 16 for k in args.ks):
        p.error("--ks: every k must lie in 1..16")
    if args.requests < 1 or args.max_tokens < 2 or args.prompt_tokens < 1 or args.repeat < 1:
        p.error("--requests, --prompt-tokens and --repeat must be >= 1, --max-tokens >= 2")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        target = load_model(args.model)
        draft = load_model(args.draft_model) if args.method == "draft" else None
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    requests = make_requests(target, args.requests, args.prompt_tokens, args.temperature)
    plains, specs = sweep(target, draft, args, requests)
    rows, plain = summarize(args, plains, specs)
    v = verdict(rows)
    meta = {"command": command_line("bench.spec_decode", argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "model": args.model,
            "draft_model": args.draft_model if args.method == "draft" else None, "method": args.method,
            "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "events": args.events, "repeat": args.repeat, "ks": args.ks}
    print_report(meta, rows, plain, v)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "plain": plain, "rows": rows, "target": v}, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
