"""Engine benchmark: what the engine's design choices are worth, measured in one run.

    python -m bench.engine [--quick] [--json OUT.json] [--model demo] [--repeat N]

Every engine configuration serves the *same* seeded mixed workload: prompts drawn from the prompt
pool (`kvscope.backend.scenario.draw_prompt`), varied lengths and output budgets, Poisson arrivals counted in
engine steps, greedy sampling with `ignore_eos` so that every configuration generates exactly the
same number of tokens. Only the loop that delivers requests and steps the engine is timed.

What is measured, and why:
1. Throughput (output tokens per second of wall time) for continuous batching, continuous batching
   with events off, static batching, no KV cache and the contiguous (pre-paging) KV layout: what
   each mechanism buys on one workload.
2. Hugging Face `generate()` on the same weights, in padded static batches of 16 (left padding,
   attention mask, greedy, `max_new_tokens` = the batch's largest budget; only each request's own
   budget counts as useful tokens): an outside reference, so the numbers are not only relative to
   ourselves. Target: continuous batching >= 3x.
3. The cost of watching: full events against events off, as a share of step time. Target <= 5%.
4. Why a KV cache: one request at contexts 128..1024, time per output token after the first (the
   first costs one prefill either way) with and without the cache. Without it every token recomputes
   the whole prefix, so the slowdown must grow with the context (>= 10x at 1024).
5. KV slot use: the time-averaged fraction of reserved cache slots that hold a token
   (1 - kv_waste_mean / kv_usage_mean), paged against contiguous. Target >= 96% paged.

The tables are markdown, headed by the command line, thread count and date, ready for
docs/benchmarks.md. `--quick` shrinks everything to a smoke run; its numbers mean little.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel, ModelLoadError, load_model, resolve_model_dir
from kvscope.backend.scenario import draw_prompt
from bench.report import command_line, progress, table

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 16
HF_BATCH_SIZE = 16
DEVICE = "cpu"  # the engine and transformers must run where the other runs

TARGET_HF_RATIO = 3.0
TARGET_EVENTS_PCT = 5.0
TARGET_SLOWDOWN_AT_1024 = 10.0
TARGET_PAGED_FILL = 0.96


@dataclass(frozen=True)
class WorkloadSpec:
    count: int
    prompt_tokens: tuple[int, int]  # inclusive range
    max_tokens: tuple[int, int]  # inclusive range
    rate_per_step: float  # Poisson arrivals: requests per engine step
    contexts: tuple[int, ...]  # the no-cache sweep
    sweep_new_tokens: int
    seed: int = 0


FULL = WorkloadSpec(48, (16, 256), (8, 256), 2.0, (128, 256, 512, 1024), 16)
QUICK = WorkloadSpec(6, (16, 64), (4, 12), 1.0, (64, 128), 4)


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    arrival_step: int
    prompt: list[int]
    max_tokens: int


@dataclass
class EngineRun:
    seconds: float  # the best of the repeats
    steps: int
    output_tokens: int
    kv_usage_mean: float
    kv_waste_mean: float
    num_events: int
    seconds_all: list[float] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps

    @property
    def kv_fill(self) -> float:
        """Of the reserved slots, the fraction holding a token (time-averaged)."""
        return 1.0 - self.kv_waste_mean / self.kv_usage_mean if self.kv_usage_mean else 0.0

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        return d | {"tokens_per_s": self.tokens_per_s, "step_ms": self.step_ms, "kv_fill": self.kv_fill}


@dataclass
class HFRun:
    seconds: float
    useful_tokens: int  # each request's own max_tokens
    generated_tokens: int  # including the tokens past a request's budget in its batch
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        return d | {"tokens_per_s": self.tokens_per_s, "batch_size": HF_BATCH_SIZE}


# ---- the workload ---------------------------------------------------------------------------------


def make_workload(loaded: LoadedModel, spec: WorkloadSpec) -> list[BenchRequest]:
    """Seeded: the same prompts, budgets and arrival steps on every run and for every configuration."""
    rng = random.Random(spec.seed)
    out, clock = [], 0.0
    for i in range(spec.count):
        prompt = draw_prompt(loaded.tokenizer, rng.randint(*spec.prompt_tokens), rng)
        out.append(BenchRequest(f"b{i}", int(clock), prompt, rng.randint(*spec.max_tokens)))
        clock += rng.expovariate(spec.rate_per_step)
    return out


def describe_workload(workload: list[BenchRequest], spec: WorkloadSpec) -> dict:
    prompts = [len(r.prompt) for r in workload]
    return {"requests": len(workload), "prompt_tokens_range": list(spec.prompt_tokens),
            "prompt_tokens_mean": sum(prompts) / len(prompts), "max_tokens_range": list(spec.max_tokens),
            "output_tokens": sum(r.max_tokens for r in workload), "arrival_rate_per_step": spec.rate_per_step,
            "last_arrival_step": max(r.arrival_step for r in workload), "seed": spec.seed}


# ---- driving the engine ---------------------------------------------------------------------------


def engine_configs(spec: WorkloadSpec) -> dict[str, EngineConfig]:
    """The configurations compared on the mixed workload; all share one max_model_len."""
    longest = spec.prompt_tokens[1] + spec.max_tokens[1]
    base = EngineConfig(block_size=BLOCK_SIZE, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=512,
                        max_model_len=math.ceil(longest / BLOCK_SIZE) * BLOCK_SIZE, device=DEVICE)
    return {
        "continuous": base,
        "events_off": base.model_copy(update={"events": "off"}),
        "static": base.model_copy(update={"batching": "static"}),
        # Without a cache a sequence is recomputed whole, so the budget must hold the longest one.
        "no_kv_cache": base.model_copy(update={"kv_cache": False,
                                               "max_num_batched_tokens": max(512, base.max_model_len)}),
        "contiguous": base.model_copy(update={"kv_layout": "contiguous"}),
        # Paging reserves nothing up front, so the same memory admits more sequences at once.
        "continuous_48": base.model_copy(update={"max_num_seqs": 48, "max_num_batched_tokens": 1024}),
    }


LABELS = {
    "continuous": "continuous batching",
    "events_off": "continuous, events off",
    "static": "static batching",
    "no_kv_cache": "no KV cache (recompute)",
    "contiguous": "contiguous KV layout",
    "continuous_48": "continuous batching, 48 sequences",
}


class EventCounter:
    """The cheapest subscriber: full events are built and delivered, as to a trace writer."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: dict) -> None:
        self.count += 1


def new_engine(loaded: LoadedModel, config: EngineConfig) -> tuple[Engine, EventCounter]:
    bus = EventBus(level=config.events)
    counter = EventCounter()
    bus.subscribe(counter)
    engine = Engine(loaded, config, bus)
    engine.emit_header()
    return engine, counter


def drive(engine: Engine, workload: list[BenchRequest]) -> float:
    """Deliver each request at its arrival step and step to the end; returns the loop's seconds."""
    pending = deque(sorted(workload, key=lambda r: r.arrival_step))
    max_steps = 64 + pending[-1].arrival_step + sum(4 * (len(r.prompt) + r.max_tokens) for r in pending)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_step <= engine.step_no:
            r = pending.popleft()
            engine.add_request(r.request_id, r.prompt, r.max_tokens, GREEDY)
        engine.step()
        if engine.step_no > max_steps:
            raise RuntimeError(f"the engine did not finish the workload in {max_steps} steps")
    return time.perf_counter() - start


def run_engine(loaded: LoadedModel, config: EngineConfig, workload: list[BenchRequest]) -> EngineRun:
    engine, counter = new_engine(loaded, config)
    seconds = drive(engine, workload)
    usage, waste = engine.metrics.mean_kv()
    outputs = {rid: r.seq.output_token_ids for rid, r in engine.requests.items()}
    return EngineRun(seconds, engine.step_no, sum(map(len, outputs.values())), usage, waste, counter.count,
                     [seconds], outputs)


def best_of(repeat: int, loaded: LoadedModel, config: EngineConfig, workload: list[BenchRequest]) -> EngineRun:
    """Repeats differ only in timing (greedy, same schedule): keep the fastest, record all."""
    runs = [run_engine(loaded, config, workload) for _ in range(repeat)]
    best = min(runs, key=lambda r: r.seconds)
    best.seconds_all = [r.seconds for r in runs]
    return best


def warm_up(loaded: LoadedModel, config: EngineConfig, workload: list[BenchRequest]) -> None:
    """The whole workload once, untimed: the first pass over every tensor shape allocates and picks
    kernels, and made the first configuration measured ~2x slower than the same one run again."""
    run_engine(loaded, config, workload)


def check_same_work(runs: dict[str, EngineRun], workload: list[BenchRequest]) -> None:
    expected = sum(r.max_tokens for r in workload)
    wrong = {name: run.output_tokens for name, run in runs.items() if run.output_tokens != expected}
    if wrong:
        raise RuntimeError(f"configurations generated different token counts (expected {expected}): {wrong}")


def same_outputs(a: dict[str, list[int]], b: dict[str, list[int]]) -> int:
    """Requests whose greedy tokens agree (batching changes fp32 rounding, which may flip near-ties)."""
    return sum(a[rid] == b.get(rid) for rid in a)


# ---- Hugging Face transformers, the outside reference ---------------------------------------------


def hf_supported(loaded: LoadedModel) -> bool:
    return loaded.config.architecture == "LlamaForCausalLM"


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [batch, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [batch, width]
    return ids, mask


def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy, exactly new_tokens per row (min_new_tokens suppresses EOS, like ignore_eos)."""
    ids, mask = left_pad(prompts, pad_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    return out[:, ids.shape[1]:].tolist(), seconds


def run_hf(model_dir: Path, workload: list[BenchRequest]) -> HFRun:
    """Arrival order, static batches of HF_BATCH_SIZE; every request is there from the start."""
    import transformers  # slow to import: only when the comparison runs

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    ordered = sorted(workload, key=lambda r: r.arrival_step)
    hf_generate(hf, [r.prompt for r in ordered[:HF_BATCH_SIZE]], 8)  # warm-up at full batch size, untimed
    run = HFRun(0.0, 0, 0)
    for i in range(0, len(ordered), HF_BATCH_SIZE):
        batch = ordered[i : i + HF_BATCH_SIZE]
        new_tokens = max(r.max_tokens for r in batch)
        rows, seconds = hf_generate(hf, [r.prompt for r in batch], new_tokens)
        run.seconds += seconds
        run.generated_tokens += new_tokens * len(batch)
        for r, row in zip(batch, rows):
            run.outputs[r.request_id] = row[: r.max_tokens]
            run.useful_tokens += r.max_tokens
    return run


# ---- the KV cache at growing context --------------------------------------------------------------


def sweep_config(kv_cache: bool) -> EngineConfig:
    # Events off: both sides would pay the same per-step event cost; this measures the model's work.
    return EngineConfig(block_size=BLOCK_SIZE, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=1100,
                        max_model_len=1100, kv_cache=kv_cache, events="off", device=DEVICE)


def time_per_output_token(loaded: LoadedModel, kv_cache: bool, prompt: list[int], new_tokens: int) -> float:
    """Mean seconds per output token after the first (the first is one prefill with or without a cache)."""
    engine, _ = new_engine(loaded, sweep_config(kv_cache))
    drive(engine, [BenchRequest("ctx", 0, prompt, new_tokens)])
    return engine.requests["ctx"].times.tpot()


def no_cache_sweep(loaded: LoadedModel, spec: WorkloadSpec) -> list[dict]:
    rng = random.Random(spec.seed + 1)
    rows = []
    for context in spec.contexts:
        prompt = draw_prompt(loaded.tokenizer, context - spec.sweep_new_tokens, rng)
        with_cache = time_per_output_token(loaded, True, prompt, spec.sweep_new_tokens)
        without = time_per_output_token(loaded, False, prompt, spec.sweep_new_tokens)
        rows.append({"context": context, "tpot_cache_s": with_cache, "tpot_no_cache_s": without,
                     "slowdown": without / with_cache})
    return rows


# ---- targets --------------------------------------------------------------------------------------


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("✓" if ok else "✗")


def events_cost_pct(runs: dict[str, EngineRun]) -> float:
    """Of a full-events step, the share that events take (the two runs schedule identically)."""
    full, off = runs["continuous"].seconds, runs["events_off"].seconds
    return 100.0 * (full - off) / full


def sweep_verdict(rows: list[dict]) -> tuple[bool, bool | None]:
    """(slowdown grows with context, slowdown at 1024 >= target; None when 1024 was not measured)."""
    slowdowns = [r["slowdown"] for r in rows]
    grows = all(a < b for a, b in zip(slowdowns, slowdowns[1:]))
    at_1024 = [r["slowdown"] for r in rows if r["context"] == 1024]
    return grows, (at_1024[0] >= TARGET_SLOWDOWN_AT_1024 if at_1024 else None)


def targets(runs: dict[str, EngineRun], hf: HFRun | None, sweep: list[dict]) -> list[dict]:
    ratio = runs["continuous"].tokens_per_s / hf.tokens_per_s if hf else None
    pct = events_cost_pct(runs)
    grows, at_1024 = sweep_verdict(sweep)
    fill = runs["continuous"].kv_fill
    at_1024_value = next((r["slowdown"] for r in sweep if r["context"] == 1024), None)
    return [
        {"name": "continuous / HF generate throughput", "target": f">= {TARGET_HF_RATIO:g}x",
         "value": None if ratio is None else f"{ratio:.2f}x",
         "met": None if ratio is None else ratio >= TARGET_HF_RATIO},
        {"name": "events cost (full vs off)", "target": f"<= {TARGET_EVENTS_PCT:g}% of step time",
         "value": f"{pct:.1f}%", "met": pct <= TARGET_EVENTS_PCT},
        {"name": "no-cache slowdown grows with context", "target": "increasing",
         "value": " < ".join(f"{r['slowdown']:.1f}x" for r in sweep), "met": grows},
        {"name": "no-cache slowdown at 1024", "target": f">= {TARGET_SLOWDOWN_AT_1024:g}x",
         "value": None if at_1024_value is None else f"{at_1024_value:.1f}x", "met": at_1024},
        {"name": "paged KV slots holding tokens", "target": f">= {100 * TARGET_PAGED_FILL:g}%",
         "value": f"{100 * fill:.1f}%", "met": fill >= TARGET_PAGED_FILL},
    ]


# ---- printing -------------------------------------------------------------------------------------


def print_header(meta: dict) -> None:
    w = meta["workload"]
    print("## Engine benchmark\n")
    print(f"- command: `{meta['command']}`")
    print(f"- date: {meta['date']}")
    print(f"- torch threads: {meta['torch_threads']} (torch {meta['torch']}, {meta['machine']})")
    print(f"- model: {meta['model']}, device {DEVICE}")
    print(f"- workload: {w['requests']} requests, prompts {w['prompt_tokens_range'][0]}-{w['prompt_tokens_range'][1]} "
          f"tokens (mean {w['prompt_tokens_mean']:.0f}), max_tokens {w['max_tokens_range'][0]}-"
          f"{w['max_tokens_range'][1]} ({w['output_tokens']} output tokens), Poisson arrivals "
          f"{w['arrival_rate_per_step']:g}/step (last at step {w['last_arrival_step']}), greedy, ignore_eos, "
          f"seed {w['seed']}")
    print(f"- engine: block_size {BLOCK_SIZE}, num_blocks 2048, max_num_seqs 16, max_num_batched_tokens 512, "
          f"max_model_len {meta['max_model_len']}; best of {meta['repeat']} run(s) per configuration\n")


def print_throughput(runs: dict[str, EngineRun], hf: HFRun | None) -> None:
    print("### Throughput (output tokens per second of wall time)\n")
    ref = runs["continuous"]
    rows = [[LABELS[name], run.steps, run.output_tokens, f"{run.seconds:.2f}", f"{run.tokens_per_s:.1f}",
             f"{run.tokens_per_s / hf.tokens_per_s:.2f}x" if hf else "n/a",
             f"{same_outputs(ref.outputs, run.outputs)}/{len(ref.outputs)}"] for name, run in runs.items()]
    if hf:
        rows.append([f"HF generate, static batches of {HF_BATCH_SIZE}", "-", hf.useful_tokens, f"{hf.seconds:.2f}",
                     f"{hf.tokens_per_s:.1f}", "1.00x", f"{same_outputs(ref.outputs, hf.outputs)}/{len(ref.outputs)}"])
    headers = ["configuration", "steps", "output tokens", "seconds", "tokens/s", "vs HF", "same tokens as continuous"]
    print(table(headers, rows))
    if hf:
        ratio = ref.tokens_per_s / hf.tokens_per_s
        print(f"\nTarget: continuous batching >= {TARGET_HF_RATIO:g}x HF generate: {ratio:.2f}x "
              f"{mark(ratio >= TARGET_HF_RATIO)} (HF generated {hf.generated_tokens} tokens, "
              f"{hf.useful_tokens} of them within a request's budget)\n")
    else:
        print("\nHF generate: skipped (only LlamaForCausalLM folders load in transformers)\n")


def print_events(runs: dict[str, EngineRun]) -> None:
    print("### Events cost (same workload)\n")
    rows = [[level, runs[name].steps, runs[name].num_events, f"{runs[name].step_ms:.2f}"]
            for level, name in (("full", "continuous"), ("off", "events_off"))]
    print(table(["events", "steps", "events emitted", "mean step ms"], rows))
    pct = events_cost_pct(runs)
    print(f"\nTarget: events cost <= {TARGET_EVENTS_PCT:g}% of step time: {pct:.1f}% "
          f"{mark(pct <= TARGET_EVENTS_PCT)}\n")


def print_kv(runs: dict[str, EngineRun]) -> None:
    print("### KV slot use (time-averaged over iterations)\n")
    rows = [[LABELS[name], f"{100 * runs[name].kv_usage_mean:.2f}%", f"{100 * runs[name].kv_waste_mean:.2f}%",
             f"{100 * runs[name].kv_fill:.1f}%"] for name in ("continuous", "contiguous")]
    print(table(["layout", "blocks reserved (of cache)", "empty reserved slots (of cache)",
                 "reserved slots holding tokens"], rows))
    fill = runs["continuous"].kv_fill
    print(f"\nTarget: paged >= {100 * TARGET_PAGED_FILL:g}% of reserved slots hold tokens: {100 * fill:.1f}% "
          f"{mark(fill >= TARGET_PAGED_FILL)}\n")


def print_sweep(rows: list[dict], new_tokens: int) -> None:
    print(f"### Without a KV cache: one request, {new_tokens} new tokens, time per output token after the first\n")
    print(table(["context", "with cache ms/token", "without cache ms/token", "slowdown"],
                [[r["context"], f"{1000 * r['tpot_cache_s']:.2f}", f"{1000 * r['tpot_no_cache_s']:.2f}",
                  f"{r['slowdown']:.1f}x"] for r in rows]))
    grows, at_1024 = sweep_verdict(rows)
    print(f"\nTarget: slowdown grows with context {mark(grows)}; >= {TARGET_SLOWDOWN_AT_1024:g}x at 1024 "
          f"{mark(at_1024)}\n")


def print_targets(rows: list[dict]) -> None:
    print("### Targets\n")
    print(table(["measure", "target", "measured", "met"],
                [[r["name"], r["target"], r["value"] or "n/a", mark(r["met"])] for r in rows]))
    print()


# ---- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small smoke run (6 requests, short prompts)")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write every number to this file")
    p.add_argument("--model", default="demo", help="shipped model name or model folder (default: demo)")
    p.add_argument("--repeat", type=int, default=3, help="runs per engine configuration; the fastest counts")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    spec = QUICK if args.quick else FULL
    try:
        loaded = load_model(args.model)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workload = make_workload(loaded, spec)
    configs = engine_configs(spec)
    meta = {"command": command_line("bench.engine", argv),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "model": args.model, "quick": args.quick,
            "repeat": args.repeat, "max_model_len": configs["continuous"].max_model_len,
            "workload": describe_workload(workload, spec)}
    print_header(meta)

    warm_up(loaded, configs["continuous"], workload)
    runs = {}
    for name, config in configs.items():
        progress(f"engine: {LABELS[name]}")
        # No-cache recomputes every prefix (minutes): once is enough to show the gap.
        runs[name] = best_of(1 if name == "no_kv_cache" else args.repeat, loaded, config, workload)
    check_same_work(runs, workload)
    hf = None
    if hf_supported(loaded):
        progress("HF transformers generate()")
        hf = run_hf(resolve_model_dir(args.model), workload)
    print_throughput(runs, hf)
    print_events(runs)
    print_kv(runs)

    progress("no-cache sweep over contexts " + ", ".join(map(str, spec.contexts)))
    sweep = no_cache_sweep(loaded, spec)
    print_sweep(sweep, spec.sweep_new_tokens)
    verdicts = targets(runs, hf, sweep)
    print_targets(verdicts)

    if args.json:
        results = {"meta": meta, "engine": {name: run.to_json() for name, run in runs.items()},
                   "hf": hf.to_json() if hf else None,
                   "ratios": {"continuous_over_hf": runs["continuous"].tokens_per_s / hf.tokens_per_s if hf else None,
                              **{f"{name}_over_continuous": run.tokens_per_s / runs["continuous"].tokens_per_s
                                 for name, run in runs.items() if name != "continuous"}},
                   "events_cost_pct": events_cost_pct(runs), "no_cache_sweep": sweep,
                   "kv_fill": {"paged": runs["continuous"].kv_fill, "contiguous": runs["contiguous"].kv_fill},
                   "targets": verdicts}
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
