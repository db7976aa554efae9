"""Disaggregated prefill and decode against colocated engines: one Poisson workload, measured in one run, and
the pricing of backend/perf/disaggregation.py set against it.

    python -m bench.disaggregation [--requests 32] [--rate R] [--seed 0] [--rounds 2] [--json OUT.json]

The workload (seeded) is the case disaggregation is for: short prompts decoding long outputs, and among them
every LONG_EVERY-th request a long prompt with a short output. Arrivals are Poisson in seconds, not in
engine steps: steps of the layouts last differently (a colocated step may carry a 512-token prompt chunk, a
decode instance's never does), so arrivals counted in steps would load each layout at another rate. The
default rate is LOAD times what the colocated engine served in the warm-up with every request given at once.

Three layouts serve it, all on the demo model, greedy with ignore_eos (the same tokens everywhere):
- colocated x1: one engine, prompts in chunks beside the decodes (chunked prefill);
- colocated x2: two such engines, requests dealt round robin: the same hardware as 1+1;
- disaggregated 1+1: a prefill instance and a decode instance, the KV moving over a gloo group.
The instances of a disaggregated run (and the two colocated engines) run one after another in this one
process, each timed on a clock of its own: the seconds it spent stepping, as a machine of its own would count
them, plus the idle gaps until an arrival. So the figures model separate machines of this one's speed. A
disaggregated run's instances step in lockstep: a request that arrives mid-step waits for the end of the
run's step, up to one decode step longer than a prefill machine of its own would make it wait.

A warm-up run of each layout (every request at once, untimed) comes first; then `--rounds` rounds, each
running the three layouts in a rotated order, so that a busy moment of the machine hits each of them. The
figures pool the requests of every round. Goodput counts the requests that meet both SLOs, set relative to
the colocated x1 medians (SLO_TTFT_X and SLO_TPOT_X of them) so that they mean the same on any machine, per
second of the runs.

The modelled table prices the same requests (each its own class, at rate / requests) with
backend/perf/disaggregation.py on this machine's profile, measured afresh, its overheads fitted on
perf_validate's calibration run (not this workload), and the link fitted to the run's own transfers
(latency + bytes / bandwidth, as link_calibrate fits a ring): modelled beside measured means, and their
ratio. The link is the run's own measurement, so its row checks the form of a transfer's time, not its rate;
the TTFT, prefill, queue and TPOT rows are predictions. The split of TTFT is where the engine puts it: a
short prompt scheduled beside a long prompt's chunk waits for that step inside its "prefill", where the
model's one-prompt-at-a-time queue counts it as queueing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import asdict, dataclass

import torch

from bench.perf_validate import measure_overheads, model_deployment, with_overheads
from bench.report import command_line, progress, table
from kvscope.backend.config import DisaggregationConfig, EngineConfig
from kvscope.backend.engine.disaggregated import DisaggregatedEngine, InstanceClock, build_engine
from kvscope.backend.engine.engine import Engine, load_runtime
from kvscope.backend.engine.request import Request
from kvscope.backend.engine.sampling_params import SamplingParams
from kvscope.backend.events.bus import EventBus
from kvscope.backend.model.loader import LoadedModel
from kvscope.backend.perf.calibrate import this_machine
from kvscope.backend.perf.disaggregation import Pool, Priced, RequestClass, price_colocated, price_disaggregated
from kvscope.backend.perf.hardware import HardwareProfile, LinkProfile, profile_from
from kvscope.backend.perf.least_squares import nonnegative_least_squares
from kvscope.backend.run import WEIGHTS, cached_model
from kvscope.backend.scenario import draw_prompt

MODEL = "demo"
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(block_size=16, num_blocks=1024, max_num_seqs=32, max_num_batched_tokens=512,
                      max_model_len=1024, events="summary", device="cpu")
LONG_EVERY = 6  # one request in six brings a long prompt
SHORT_PROMPT, SHORT_OUTPUT = (16, 64), (48, 96)
LONG_PROMPT, LONG_OUTPUT = (600, 900), (8, 16)
LOAD = 0.5  # the default rate: this share of the colocated engine's all-at-once throughput
SLO_TTFT_X, SLO_TPOT_X = 2.0, 1.25  # the SLOs: these multiples of colocated x1's median TTFT and TPOT
CALIBRATION_TOKENS = 48  # output tokens of perf_validate's calibration requests (the overhead fit)
MIN_DIVISOR_S = 1e-4  # a time below this divides into noise (an idle engine's queue): its ratios are left out
LAYOUTS = ("colocated x1", "colocated x2", "disaggregated 1+1")
ENGINES = {"colocated x1": 1, "colocated x2": 2, "disaggregated 1+1": 2}


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Served:
    """One request's times, as its engine's clock read them (seconds)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float
    queue_s: float
    transfer_s: float
    kv_bytes: int

    @property
    def prefill_s(self) -> float:
        """From its first scheduled step to its first token, the link's time left out."""
        return self.ttft_s - self.queue_s - self.transfer_s


@dataclass
class Run:
    served: list[Served]
    seconds: float  # the run's time: its last engine's clock at the end
    transfers: list[tuple[int, float]]  # (bytes, seconds) of each kv_transfer


# ---- the workload -------------------------------------------------------------------------------------

def make_workload(loaded: LoadedModel, count: int, rate: float, seed: int) -> list[BenchRequest]:
    """Seeded: the same prompts, budgets and arrival times for every layout; unit-rate gaps scaled by `rate`,
    so that changing the rate moves the arrivals and nothing else."""
    rng = random.Random(seed)
    out, clock = [], 0.0
    for i in range(count):
        long = i % LONG_EVERY == LONG_EVERY - 1
        prompt = draw_prompt(loaded.tokenizer, rng.randint(*(LONG_PROMPT if long else SHORT_PROMPT)), rng)
        out.append(BenchRequest(f"r{i}", clock / rate, prompt, rng.randint(*(LONG_OUTPUT if long else SHORT_OUTPUT))))
        clock += rng.expovariate(1.0)
    return out


def at_once(workload: list[BenchRequest]) -> list[BenchRequest]:
    return [BenchRequest(r.request_id, 0.0, r.prompt, r.max_tokens) for r in workload]


# ---- the layouts, each on clocks of its own ---------------------------------------------------------------

class Colocated:
    """One engine on a clock of its own, as each disaggregated instance has: the seconds it spent stepping."""

    def __init__(self, loaded: LoadedModel, bus: EventBus) -> None:
        self.clock = InstanceClock()
        runtime = load_runtime(loaded, CONFIG, WEIGHTS)
        runtime.clock = self.clock
        self.engine = Engine(loaded, CONFIG, bus, runtime=runtime, shared=WEIGHTS)

    def now(self) -> float:
        return self.clock()

    def wait_until(self, t: float) -> None:
        self.clock.seconds = max(self.clock.seconds, t)

    def step(self) -> None:
        with self.clock.running():
            self.engine.step()


class Disaggregated:
    """A DisaggregatedEngine: its instances keep their own clocks, and the run's time is its `elapsed`."""

    def __init__(self, loaded: LoadedModel, bus: EventBus) -> None:
        config = CONFIG.model_copy(update={"disaggregation": DisaggregationConfig()})
        engine = build_engine(loaded, config, bus, shared=WEIGHTS)
        assert isinstance(engine, DisaggregatedEngine)
        self.engine = engine

    def now(self) -> float:
        return self.engine.clock()

    def wait_until(self, t: float) -> None:
        self.engine.elapsed = max(self.engine.elapsed, t)

    def step(self) -> None:
        self.engine.step()


def serve(server: Colocated | Disaggregated, workload: list[BenchRequest]) -> float:
    """Each request handed over once the server's clock reaches its arrival (an idle server's clock jumps to
    it), stepping to the end; returns the server's clock at the end."""
    pending = deque(sorted(workload, key=lambda r: r.arrival_s))
    engine, steps = server.engine, 0
    max_steps = 64 + sum(4 * (len(r.prompt) + r.max_tokens) for r in workload)
    while pending or engine.has_unfinished():
        if not engine.has_unfinished():
            server.wait_until(pending[0].arrival_s)
        while pending and pending[0].arrival_s <= server.now():
            r = pending.popleft()
            engine.add_request(r.request_id, r.prompt, r.max_tokens, GREEDY, arrival=r.arrival_s)
        server.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"the workload did not finish in {max_steps} steps")
    return server.now()


def run_layout(loaded: LoadedModel, layout: str, workload: list[BenchRequest]) -> Run:
    """The workload on one layout; colocated x2 deals it round robin to two engines, each run on its own."""
    parts = [workload[i::2] for i in range(2)] if layout == "colocated x2" else [workload]
    runs = [run_part(loaded, layout, part) for part in parts]
    return Run([s for r in runs for s in r.served], max(r.seconds for r in runs),
               [t for r in runs for t in r.transfers])


def run_part(loaded: LoadedModel, layout: str, workload: list[BenchRequest]) -> Run:
    bus = EventBus(level=CONFIG.events)
    transfers: dict[str, tuple[int, float]] = {}
    bus.subscribe(lambda e: transfers.__setitem__(e["request_id"], (e["bytes"], e["link_s"]))
                  if e["type"] == "kv_transfer" else None)
    server = Disaggregated(loaded, bus) if layout.startswith("disaggregated") else Colocated(loaded, bus)
    try:
        seconds = serve(server, workload)
        served = [served_request(r, transfers.get(r.request_id, (0, 0.0))[0])
                  for r in server.engine.requests.values()]
    finally:
        server.engine.close()
    return Run(served, seconds, list(transfers.values()))


def served_request(r: Request, kv_bytes: int) -> Served:
    t = r.times
    if r.finish_reason not in ("length", "stop") or t.tpot() is None:
        raise RuntimeError(f"request {r.request_id} ended {r.finish_reason} ({r.abort_reason})")
    return Served(r.request_id, len(r.prompt_ids), t.num_output_tokens, t.ttft(), t.tpot(), t.queue(),
                  t.transfer_s or 0.0, kv_bytes)


# ---- figures ------------------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    """Linear between the order statistics (numpy's default)."""
    s = sorted(xs)
    at = q * (len(s) - 1)
    low = math.floor(at)
    return s[low] + (s[min(low + 1, len(s) - 1)] - s[low]) * (at - low)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, s: Served) -> bool:
        return s.ttft_s <= self.ttft_s and s.tpot_s <= self.tpot_s


def summarize(runs: list[Run], slo: Slo) -> dict:
    """One layout's figures over every round's requests."""
    served = [s for r in runs for s in r.served]
    ttft, tpot = [s.ttft_s for s in served], [s.tpot_s for s in served]
    moved = [s for s in served if s.kv_bytes]
    transfers = [t for r in runs for t in r.transfers]
    seconds = sum(r.seconds for r in runs)
    good = sum(slo.met(s) for s in served)
    return {
        **{f"ttft_p{q}_s": percentile(ttft, q / 100) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": percentile(tpot, q / 100) for q in (50, 90, 99)},
        "ttft_mean_s": statistics.fmean(ttft), "tpot_mean_s": statistics.fmean(tpot),
        "queue_mean_s": statistics.fmean(s.queue_s for s in served),
        "prefill_mean_s": statistics.fmean(s.prefill_s for s in served),
        "transfer_mean_s": statistics.fmean(s.transfer_s for s in served),
        "kv_bytes_per_request": statistics.fmean(s.kv_bytes for s in moved) if moved else 0.0,
        "link_s_per_request": statistics.fmean(s.transfer_s for s in moved) if moved else 0.0,
        "link_bytes_per_s": sum(b for b, _ in transfers) / sum(s for _, s in transfers) if transfers else 0.0,
        "requests": len(served), "slo_met": good / len(served), "goodput_per_s": good / seconds,
        "run_s": seconds / len(runs),
    }


# ---- the model beside the measurement ---------------------------------------------------------------------

def fit_link(transfers: list[tuple[int, float]]) -> LinkProfile:
    """latency + bytes / bandwidth over the transfers, least squares relative to each one's time (as
    link_calibrate fits the ring), neither term negative."""
    rows = [(1 / s, b / s) for b, s in transfers]
    latency, per_byte = nonnegative_least_squares(rows, [1.0] * len(rows))
    return LinkProfile("gloo loopback", 1 / max(per_byte, 1e-13), latency, local=True)


def priced(profile: HardwareProfile, link: LinkProfile, workload: list[BenchRequest], rate: float,
           overheads: dict[str, float]) -> dict[str, Priced]:
    """Each layout priced on this machine, each request a class of its own at rate / requests."""
    dep = with_overheads(model_deployment(MODEL, profile), overheads)
    classes = [RequestClass(len(r.prompt), r.max_tokens, rate / len(workload)) for r in workload]

    def engines(n: int) -> Pool:
        return Pool(dep, n, CONFIG.max_num_batched_tokens, CONFIG.max_num_seqs)

    return {"colocated x1": price_colocated(engines(1), classes), "colocated x2": price_colocated(engines(2), classes),
            "disaggregated 1+1": price_disaggregated(engines(1), engines(1), link, classes, CONFIG.block_size)}


MODELLED = (("TTFT", "ttft_mean_s", "ttft_s"), ("queue", "queue_mean_s", "queue_s"),
            ("prefill", "prefill_mean_s", "prefill_s"), ("KV transfer", "transfer_mean_s", "transfer_s"))


def model_rows(measured: dict[str, dict], model: dict[str, Priced]) -> list[dict]:
    rows = []
    for layout, p in model.items():
        figures = [(name, key, p.mean(attr)) for name, key, attr in MODELLED] + [("TPOT", "tpot_mean_s", p.tpot_s)]
        for name, key, value in figures:
            if layout.startswith("colocated") and name == "KV transfer":
                continue
            m = measured[layout][key]
            rows.append({"layout": layout, "figure": f"{name} mean", "measured_s": m,
                         "modelled_s": None if math.isinf(value) else value,
                         "ratio": value / m if m and not math.isinf(value) else None})
    return rows


# ---- printing -------------------------------------------------------------------------------------------------

def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def ratio(a: float, b: float, key: str) -> str:
    """a / b; "-" for times under MIN_DIVISOR_S, whose ratio is noise (a queue of 0.01 ms)."""
    small = key.endswith("_s") and b < MIN_DIVISOR_S
    return "-" if small or not b else f"{a / b:.2f}"


FIGURES = (
    *((f"TTFT p{q} (ms)", f"ttft_p{q}_s", ms) for q in (50, 90, 99)),
    *((f"TPOT p{q} (ms)", f"tpot_p{q}_s", ms) for q in (50, 90, 99)),
    ("TTFT: queue, mean (ms)", "queue_mean_s", ms), ("TTFT: prefill, mean (ms)", "prefill_mean_s", ms),
    ("TTFT: KV transfer, mean (ms)", "transfer_mean_s", lambda x: f"{x * 1e3:.2f}"),
    ("KV moved per request (KB)", "kv_bytes_per_request", lambda x: f"{x / 1e3:.0f}"),
    ("link time per request (ms)", "link_s_per_request", lambda x: f"{x * 1e3:.2f}"),
    ("link rate (GB/s)", "link_bytes_per_s", lambda x: f"{x / 1e9:.2f}"),
    ("SLO met", "slo_met", lambda x: f"{x:.0%}"), ("goodput (requests/s)", "goodput_per_s", lambda x: f"{x:.2f}"),
    ("run (s, mean of rounds)", "run_s", lambda x: f"{x:.1f}"),
)
NO_RATIO = ("kv_bytes_per_request", "link_s_per_request", "link_bytes_per_s", "transfer_mean_s")


def measured_table(summary: dict[str, dict]) -> str:
    c1, c2, d = (summary[k] for k in LAYOUTS)
    rows = [["engines (machines modelled)", 1, 2, 2, "", ""]]
    for label, key, fmt in FIGURES:
        ratios = ["", ""] if key in NO_RATIO else [ratio(d[key], c1[key], key), ratio(d[key], c2[key], key)]
        rows.append([label, fmt(c1[key]), fmt(c2[key]), fmt(d[key]), *ratios])
    return table(["", *LAYOUTS, "disagg ÷ coloc x1", "disagg ÷ coloc x2"], rows)


def model_table(rows: list[dict]) -> str:
    return table(["layout", "figure", "measured (ms)", "modelled (ms)", "modelled ÷ measured"],
                 [[r["layout"], r["figure"], ms(r["measured_s"]),
                   "saturated" if r["modelled_s"] is None else ms(r["modelled_s"]),
                   "-" if r["ratio"] is None or r["measured_s"] < MIN_DIVISOR_S else f"{r['ratio']:.2f}"]
                  for r in rows])


def header(argv: list[str], workload: list[BenchRequest], rate: float, rate_why: str, rounds: int, slo: Slo) -> str:
    long = sum(len(r.prompt) >= LONG_PROMPT[0] for r in workload)
    return "\n".join([
        f"`{command_line('bench.disaggregation', argv)}`, {datetime.date.today()}, torch threads "
        f"{torch.get_num_threads()}: {len(workload)} requests ({long} with prompts of {LONG_PROMPT[0]}-"
        f"{LONG_PROMPT[1]} tokens and {LONG_OUTPUT[0]}-{LONG_OUTPUT[1]} output tokens, the rest "
        f"{SHORT_PROMPT[0]}-{SHORT_PROMPT[1]} and {SHORT_OUTPUT[0]}-{SHORT_OUTPUT[1]}), Poisson arrivals at "
        f"{rate:.2f} requests/s{rate_why}, {rounds} round(s); chunks of {CONFIG.max_num_batched_tokens} tokens, "
        f"up to {CONFIG.max_num_seqs} sequences per engine.",
        "The instances of the disaggregated run and the two engines of colocated x2 run one after another in this "
        "process, each timed on its own clock: the figures model separate machines of this one's speed. "
        "colocated x1 has half the machines of the other two.",
        f"SLO: TTFT <= {ms(slo.ttft_s)} ms ({SLO_TTFT_X:g} x colocated x1's median), TPOT <= {ms(slo.tpot_s)} ms "
        f"({SLO_TPOT_X:g} x its median).",
    ])


# ---- the run ----------------------------------------------------------------------------------------------------

def warm_up(loaded: LoadedModel, workload: list[BenchRequest]) -> float:
    """Every layout once, every request at once: the first pass over each shape allocates and picks kernels.
    Returns colocated x1's seconds: the default rate's measure of this machine."""
    seconds = {layout: run_layout(loaded, layout, at_once(workload)).seconds for layout in LAYOUTS}
    return seconds["colocated x1"]


def rounds_of(loaded: LoadedModel, workload: list[BenchRequest], rounds: int) -> dict[str, list[Run]]:
    """Each round runs every layout, in an order rotated by one each round."""
    runs: dict[str, list[Run]] = {layout: [] for layout in LAYOUTS}
    for k in range(rounds):
        for layout in LAYOUTS[k % 3:] + LAYOUTS[:k % 3]:
            progress(f"round {k + 1}/{rounds}: {layout}")
            runs[layout].append(run_layout(loaded, layout, workload))
    return runs


def slo_of(runs: list[Run]) -> Slo:
    served = [s for r in runs for s in r.served]
    return Slo(SLO_TTFT_X * percentile([s.ttft_s for s in served], 0.5),
               SLO_TPOT_X * percentile([s.tpot_s for s in served], 0.5))


@dataclass
class Modelled:
    profile: HardwareProfile
    overheads: dict[str, float]
    link: LinkProfile
    transfers: int
    rows: list[dict]

    def describe(self) -> str:
        p, o, link = self.profile, self.overheads, self.link
        return (f"Priced by backend/perf/disaggregation.py on {p.label}: roofs {p.fp32_flops / 1e9:.0f} GFLOP/s, "
                f"{p.mem_bandwidth / 1e9:.0f} GB/s; overheads fitted on perf_validate's calibration run "
                f"{o['fixed_s'] * 1e3:.2f} ms + {o['per_sequence_s'] * 1e3:.2f} ms per sequence + "
                f"{o['per_token_s'] * 1e6:.0f} µs per token; the link fitted to the run's {self.transfers} "
                f"transfers: {link.latency_s * 1e6:.0f} µs + bytes at {link.bandwidth / 1e9:.2f} GB/s.")


def model(workload: list[BenchRequest], rate: float, runs: dict[str, list[Run]], summary: dict[str, dict]) -> Modelled:
    """The pricing of the same workload on this machine, measured now, beside the measured means."""
    profile = profile_from(this_machine(recalibrate=True))
    overheads = measure_overheads(MODEL, model_deployment(MODEL, profile), CALIBRATION_TOKENS, 1)
    transfers = [t for r in runs["disaggregated 1+1"] for t in r.transfers]
    link = fit_link(transfers)
    return Modelled(profile, overheads, link, len(transfers),
                    model_rows(summary, priced(profile, link, workload, rate, overheads)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.disaggregation", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32, help="requests in the workload (one in six long)")
    p.add_argument("--rate", type=float, default=None,
                   help=f"requests per second (default: {LOAD:g} x the colocated engine's all-at-once throughput)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three layouts, alternated")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.requests < 2 or args.rounds < 1 or (args.rate is not None and not args.rate > 0):
        print("bench.disaggregation: --requests >= 2, --rounds >= 1 and --rate > 0", file=sys.stderr)
        return 2
    loaded = cached_model(MODEL)
    progress("warm-up: every layout, every request at once")
    seconds = warm_up(loaded, make_workload(loaded, args.requests, 1.0, args.seed))
    rate = args.rate or LOAD * args.requests / seconds
    workload = make_workload(loaded, args.requests, rate, args.seed)
    runs = rounds_of(loaded, workload, args.rounds)
    slo = slo_of(runs["colocated x1"])
    summary = {layout: {**summarize(rs, slo), "engines": ENGINES[layout]} for layout, rs in runs.items()}
    progress("pricing: this machine measured, overheads fitted")
    modelled = model(workload, rate, runs, summary)
    rate_why = "" if args.rate else f" ({LOAD:g} x colocated x1's all-at-once throughput in the warm-up)"
    print(header(argv, workload, rate, rate_why, args.rounds, slo), measured_table(summary), modelled.describe(),
          model_table(modelled.rows), sep="\n\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "rate": rate, "seed": args.seed, "rounds": args.rounds,
                       "slo": asdict(slo), "layouts": summary, "model": modelled.rows,
                       "overhead_s": modelled.overheads, "profile": modelled.profile.label,
                       "link": {"latency_s": modelled.link.latency_s, "bandwidth": modelled.link.bandwidth}},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
