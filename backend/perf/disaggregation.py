"""Disaggregated prefill and decode, priced: a request mix's TTFT and TPOT on prefill instances and decode
instances joined by a link, against colocated engines on as many GPUs (DistServe, Zhong et al., OSDI 2024;
Splitwise, Patel et al., ISCA 2024).

    python -m kvscope.backend.perf.disaggregation --model-shape llama-3-70b --hardware h100 --link infiniband \\
        --prompt-tokens 2048 --output-tokens 256 --rate 4 --prefill-tp 4 --decode-tp 4

Every step is priced by cost_model.iteration_cost. What this module adds is which steps a request meets at
a request rate, from three textbook results (docs/perf_model.md has the formulas and the limits):
- A decoding request shares each step with the others decoding (M/G/inf: it sees itself plus the mean
  number, a·t, where a = sum of rate·(output - 1) per engine and t the step): TPOT is the fixed point
  t = step(1 + a·t).
- A colocated engine also runs every prompt, in chunks of its token budget beside its decodes (chunked
  prefill, as kvscope and vLLM run it): the chunks' extra time takes a share L = sum of rate·(extra time
  of a prompt's chunks) of the engine's time, so its steps last t = step(1 + a·t) / (1 - L). A decode
  instance runs no prompt: L = 0.
- A prompt waits for the prompts ahead of it (M/G/1, Pollaczek-Khinchine): W = sum of rate·S^2 /
  (2·(1 - rho)), S a prompt's prefill time, rho = sum of rate·S, per prefill instance or colocated engine.
TTFT = W + S, and disaggregated + the KV transfer: latency + bytes / (lanes x bandwidth), the prompt's whole
blocks at the KV formula's bytes per token, each of min(prefill tp, decode tp) rank pairs carrying its
share on a link of its own (one NIC or NVLink port per GPU). A part that cannot keep up (rho or L >= 1, a
decode batch past max_batch or past memory) makes the deployment saturated: its times are infinite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvscope.backend.config import kv_storage_dtype
from kvscope.backend.perf.cost_model import BatchItem, Deployment, iteration_cost, resident_bytes
from kvscope.backend.perf.errors import PerfError, unknown_name
from kvscope.backend.perf.hardware import INSTANCE_LINKS, LinkProfile
from kvscope.backend.perf.whatif import deployment, kv_text

DEFAULT_CHUNK_TOKENS = 2048  # vLLM's max_num_batched_tokens for online serving (chunked prefill)
DEFAULT_MAX_BATCH = 256  # vLLM's max_num_seqs
DEFAULT_BLOCK_SIZE = 16  # kvscope's and vLLM's: a transfer moves the prompt's whole blocks
BISECTIONS = 60


@dataclass(frozen=True)
class RequestClass:
    """Requests of one shape arriving at `rate` per second (Poisson) to the whole deployment."""

    prompt_tokens: int
    output_tokens: int
    rate: float


@dataclass(frozen=True)
class Pool:
    """`instances` engines of one deployment (model, GPU, tp): a role's instances, or the colocated engines.
    Requests spread evenly over them, so each sees 1/instances of every class's rate."""

    dep: Deployment
    instances: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the step's token budget: a longer prompt runs in chunks
    max_batch: int = DEFAULT_MAX_BATCH  # sequences one engine decodes at once

    @property
    def gpus(self) -> int:
        return self.instances * self.dep.tp


@dataclass(frozen=True)
class ClassTimes:
    """One request class's way to its first token, mean seconds."""

    prompt_tokens: int
    output_tokens: int
    rate: float
    queue_s: float
    prefill_s: float
    transfer_s: float = 0.0
    kv_bytes: float = 0.0  # over the link (none colocated)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s


@dataclass(frozen=True)
class Priced:
    """A deployment's answer: each class's TTFT parts, the TPOT every decoding request sees, and how busy each
    part is (a share of its time; 1 or more cannot keep up)."""

    layout: str  # colocated or disaggregated
    gpus: int
    classes: list[ClassTimes]
    tpot_s: float
    decode_batch: float  # the sequences a decoding request shares its steps with, itself included
    utilization: dict[str, float]
    saturated: str | None = None  # what cannot keep up; the times are then infinite

    def mean(self, figure: str) -> float:
        """A ClassTimes figure (ttft_s, queue_s, ...) averaged over requests (each class by its rate)."""
        total = sum(c.rate for c in self.classes)
        return sum(c.rate * getattr(c, figure) for c in self.classes) / total

    def to_json(self) -> dict:
        """Infinite (saturated) times as null: JSON has no infinity."""
        d = asdict(self)
        d["classes"] = [{**asdict(c), "ttft_s": c.ttft_s} for c in self.classes]
        d |= {f: self.mean(f) for f in ("ttft_s", "queue_s", "prefill_s", "transfer_s", "kv_bytes")}
        return finite(d)


def finite(value: object) -> object:
    """The value with every infinity, however deep in dicts and lists, as None."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


# ---- steps ----------------------------------------------------------------------------------------------

def prompt_chunks(prompt_tokens: int, budget: int) -> list[BatchItem]:
    """A prompt as the steps run it: chunks of at most `budget` tokens, the last one sampling."""
    chunks, done = [], 0
    while done < prompt_tokens:
        q = min(budget, prompt_tokens - done)
        done += q
        chunks.append(BatchItem("prefill", q, done, samples=done == prompt_tokens))
    return chunks


def step_s(dep: Deployment, decodes: float, context: int, chunk: BatchItem | None = None) -> float:
    """A step of `decodes` decode rows at `context` and maybe a prefill chunk; a fractional count of rows is
    the mean of the two whole batches around it (a mean batch is rarely a whole one)."""
    low = math.floor(decodes)
    below = whole_step_s(dep, low, context, chunk)
    frac = decodes - low
    return below if frac == 0 else (1 - frac) * below + frac * whole_step_s(dep, low + 1, context, chunk)


def whole_step_s(dep: Deployment, decodes: int, context: int, chunk: BatchItem | None) -> float:
    rows = [BatchItem("decode", 1, context)] * decodes + ([chunk] if chunk else [])
    return iteration_cost(dep, rows).time_s if rows else 0.0


def budget_beside(pool: Pool, decodes: float) -> int:
    """The prefill tokens a step has room for beside its decodes."""
    return max(1, pool.chunk_tokens - math.ceil(decodes))


def prefill_s(pool: Pool, prompt_tokens: int, decodes: float, context: int) -> float:
    """A prompt's time to its first token once it is first scheduled: its chunks' steps, decodes included."""
    return sum(step_s(pool.dep, decodes, context, c)
               for c in prompt_chunks(prompt_tokens, budget_beside(pool, decodes)))


# ---- the request mix -------------------------------------------------------------------------------------

def decode_rate(classes: Sequence[RequestClass], instances: int) -> float:
    """a: decoding sequences per second of step time on one engine (Little: the batch is a·TPOT)."""
    return sum(c.rate * (c.output_tokens - 1) for c in classes) / instances


def decode_context(classes: Sequence[RequestClass]) -> int:
    """A decoding row's mean context: its prompt and half its output, weighted by the decode steps it runs."""
    weights = [c.rate * (c.output_tokens - 1) for c in classes]
    mean = sum(w * (c.prompt_tokens + c.output_tokens / 2) for w, c in zip(weights, classes, strict=True))
    return max(1, round(mean / sum(weights)))


def mg1_wait(rates: Sequence[float], services: Sequence[float]) -> float:
    """M/G/1's mean wait (Pollaczek-Khinchine): rates per second, services in seconds, one server."""
    rho = sum(r * s for r, s in zip(rates, services, strict=True))
    if rho >= 1:
        return math.inf
    return sum(r * s * s for r, s in zip(rates, services, strict=True)) / (2 * (1 - rho))


def fixed_point(step: Callable[[float], float], limit: float) -> float | None:
    """The t with step(t) = t, for a step that starts above t and grows slower than it (a decode batch grows
    with its step); None if step(limit) is still above limit: the load cannot be carried."""
    if step(limit) > limit:
        return None
    lo, hi = 0.0, limit  # step(lo) > lo, step(hi) <= hi
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) > mid else (lo, mid)
    return hi


def kv_bytes(dep: Deployment, prompt_tokens: int, block_size: int) -> float:
    """The prompt's KV, all ranks: its whole blocks at the KV formula's bytes per token."""
    kv_dtype = kv_storage_dtype(dep.kv_cache_dtype, dep.dtype)
    return math.ceil(prompt_tokens / block_size) * block_size * dep.shape.config.kv_bytes_per_token(kv_dtype)


def weights_short(pool: Pool) -> str | None:
    """Why one engine's GPU cannot hold its share of the weights, or None."""
    dep = pool.dep
    if resident_bytes(dep) <= dep.hardware.memory_bytes:
        return None
    return (f"memory: weights of {resident_bytes(dep) / 1e9:,.1f} GB per GPU at tp {dep.tp} exceed "
            f"{dep.hardware.memory_bytes / 1e9:,.1f} GB (raise tp)")


def memory_short(pool: Pool, batch: float, classes: Sequence[RequestClass]) -> str | None:
    """Why one engine cannot hold its weights and `batch` sequences' KV (whatif's test), or None."""
    hw, dep = pool.dep.hardware, pool.dep
    tokens = sum(c.rate * (c.prompt_tokens + c.output_tokens) for c in classes) / sum(c.rate for c in classes)
    need = resident_bytes(dep) + batch * tokens * dep.kv_bytes_per_token
    if need <= hw.memory_bytes:
        return None
    return (f"memory: weights {resident_bytes(dep) / 1e9:,.1f} GB + KV of {batch:,.1f} sequences exceed "
            f"{hw.memory_bytes / 1e9:,.1f} GB per GPU at tp {dep.tp}")


# ---- the two layouts -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decoding:
    tpot_s: float
    batch: float
    prefill_share: float  # L: the share of the engine's time its prompts' chunks add


def decoding(pool: Pool, classes: Sequence[RequestClass], prefills: bool) -> Decoding | None:
    """TPOT on one engine of the pool: a decode instance (prefills False) or a colocated engine, whose
    prompts' chunks share its steps; None when the decodes cannot be carried."""
    a, context = decode_rate(classes, pool.instances), decode_context(classes)

    def share(decodes: float) -> float:
        if not prefills:
            return 0.0
        alone = step_s(pool.dep, decodes, context)
        budget = budget_beside(pool, decodes)
        return sum(c.rate / pool.instances * sum(step_s(pool.dep, decodes, context, chunk) - alone
                                                 for chunk in prompt_chunks(c.prompt_tokens, budget))
                   for c in classes)

    def step(t: float) -> float:
        prefill_share = share(1 + a * t)
        return math.inf if prefill_share >= 1 else step_s(pool.dep, 1 + a * t, context) / (1 - prefill_share)

    tpot = fixed_point(step, (pool.max_batch - 1) / a)
    return None if tpot is None else Decoding(tpot, 1 + a * tpot, share(1 + a * tpot))


def saturated(layout: str, gpus: int, classes: Sequence[RequestClass], why: str, utilization: dict[str, float],
              moved: Sequence[float] | None = None) -> Priced:
    """A deployment that cannot keep up: every time infinite; the KV a request would move is still known."""
    inf = math.inf
    return Priced(layout, gpus, [ClassTimes(c.prompt_tokens, c.output_tokens, c.rate, inf, inf, inf, b)
                                 for c, b in zip(classes, moved or [0.0] * len(classes), strict=True)],
                  inf, inf, utilization, why)


def price_colocated(pool: Pool, classes: Sequence[RequestClass]) -> Priced:
    """Engines that run prompts and decodes in the same steps (chunked prefill)."""
    check_classes(classes)
    why = weights_short(pool)
    d = None if why else decoding(pool, classes, prefills=True)
    if d is None:
        return saturated("colocated", pool.gpus, classes, why or f"colocated engines: the prompts' chunks take all "
                                                                f"of the steps' time, or the decodes need more than "
                                                                f"{pool.max_batch} sequences each", {})
    others, context = d.batch - 1, decode_context(classes)
    services = [prefill_s(pool, c.prompt_tokens, others, context) for c in classes]
    rates = [c.rate / pool.instances for c in classes]
    rho = sum(r * s for r, s in zip(rates, services, strict=True))
    use = {"prefill": rho, "prefill_share": d.prefill_share}
    why = "colocated engines: prompts take all of their time" if rho >= 1 else memory_short(pool, d.batch, classes)
    if why:
        return saturated("colocated", pool.gpus, classes, why, use)
    wait = mg1_wait(rates, services)
    return Priced("colocated", pool.gpus, [ClassTimes(c.prompt_tokens, c.output_tokens, c.rate, wait, s)
                                           for c, s in zip(classes, services, strict=True)], d.tpot_s, d.batch, use)


def price_disaggregated(prefill: Pool, decode: Pool, link: LinkProfile, classes: Sequence[RequestClass],
                        block_size: int = DEFAULT_BLOCK_SIZE) -> Priced:
    """Prefill instances that run prompts alone, decode instances that run decodes alone, the KV between."""
    check_classes(classes)
    gpus = prefill.gpus + decode.gpus
    services = [prefill_s(prefill, c.prompt_tokens, 0, 0) for c in classes]
    moved = [kv_bytes(prefill.dep, c.prompt_tokens, block_size) for c in classes]
    lanes = min(prefill.dep.tp, decode.dep.tp)
    transfers = [link.latency_s + b / (lanes * link.bandwidth) for b in moved]
    rates = [c.rate / prefill.instances for c in classes]
    use = {"prefill": sum(r * s for r, s in zip(rates, services, strict=True)),
           "link": sum(r * t for r, t in zip(rates, transfers, strict=True))}
    why = weights_short(prefill) or weights_short(decode)
    d = None if why else decoding(decode, classes, prefills=False)
    why = why or ("prefill instances: prompts take all of their time" if use["prefill"] >= 1 else
                  "link: transfers take all of its time" if use["link"] >= 1 else
                  f"decode instances: the decodes need more than {decode.max_batch} sequences each" if d is None else
                  memory_short(decode, d.batch, classes) or memory_short(prefill, 1, classes))
    if why:
        return saturated("disaggregated", gpus, classes, why, use, moved)
    wait = mg1_wait(rates, services)
    return Priced("disaggregated", gpus, [ClassTimes(c.prompt_tokens, c.output_tokens, c.rate, wait, s, t, b)
                                          for c, s, t, b in zip(classes, services, transfers, moved, strict=True)],
                  d.tpot_s, d.batch, use)


def check_classes(classes: Sequence[RequestClass]) -> None:
    if not classes:
        raise PerfError("rate", "no requests to price")
    for c in classes:
        if c.prompt_tokens < 1:
            raise PerfError("prompt_tokens", f"must be >= 1, got {c.prompt_tokens}")
        if c.output_tokens < 2:
            raise PerfError("output_tokens", f"must be >= 2 (a TPOT needs two tokens), got {c.output_tokens}")
        if not math.isfinite(c.rate) or c.rate <= 0:
            raise PerfError("rate", f"requests per second: a finite number > 0, got {c.rate}")


def pool(dep: Deployment, instances: int, field: str, chunk_tokens: int, max_batch: int) -> Pool:
    if instances < 1:
        raise PerfError(field, f"must be >= 1, got {instances}")
    if chunk_tokens < 1:
        raise PerfError("chunk_tokens", f"must be >= 1, got {chunk_tokens}")
    if max_batch < 1:
        raise PerfError("max_batch", f"must be >= 1, got {max_batch}")
    return Pool(dep, instances, chunk_tokens, max_batch)


def instance_link(name: str) -> LinkProfile:
    if name not in INSTANCE_LINKS:
        raise unknown_name("link", name, list(INSTANCE_LINKS))
    return INSTANCE_LINKS[name]


# ---- the comparison --------------------------------------------------------------------------------------

def compare(model_shape: str, hardware: str, prompt_tokens: int, output_tokens: int, rate: float,
            prefill_instances: int = 1, prefill_tp: int = 1, decode_instances: int = 1, decode_tp: int = 1,
            link: str = "infiniband", colocated_instances: int | None = None, colocated_tp: int | None = None,
            chunk_tokens: int = DEFAULT_CHUNK_TOKENS, max_batch: int = DEFAULT_MAX_BATCH,
            kv_cache_dtype: str = "auto", weight_quant: str = "none") -> dict:
    """One request shape at `rate` on a disaggregated deployment and on colocated engines of tp colocated_tp
    (default decode_tp), as many as fill the same GPUs (default): both priced, as one JSON-ready dict."""
    colocated_tp = colocated_tp or decode_tp
    gpus = prefill_instances * prefill_tp + decode_instances * decode_tp
    colocated_instances = colocated_instances or max(1, gpus // colocated_tp)
    classes = [RequestClass(prompt_tokens, output_tokens, rate)]
    check_classes(classes)

    def engines(tp: int, instances: int, role: str) -> Pool:
        """A role's pool; a tp the deployment refuses is named as the role's (prefill_tp, not tp)."""
        try:
            dep = deployment(model_shape, hardware, tp, kv_cache_dtype, weight_quant)
        except PerfError as e:
            raise PerfError(f"{role}_tp" if e.field == "tp" else e.field, e.reason) from None
        return pool(dep, instances, f"{role}_instances", chunk_tokens, max_batch)

    prefill, decode = engines(prefill_tp, prefill_instances, "prefill"), engines(decode_tp, decode_instances, "decode")
    colocated = engines(colocated_tp, colocated_instances, "colocated")
    wire = instance_link(link)
    dep = prefill.dep
    return {"model_shape": dep.shape.name, "hardware": dep.hardware.name, "hardware_label": dep.hardware.label,
            "dtype": dep.dtype, "kv_cache_dtype": kv_cache_dtype, "weight_quant": weight_quant,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "rate": rate,
            "chunk_tokens": chunk_tokens, "max_batch": max_batch,
            "link": {"name": wire.name, "bandwidth": wire.bandwidth, "latency_s": wire.latency_s,
                     "lanes": min(prefill_tp, decode_tp)},
            "prefill": {"instances": prefill_instances, "tp": prefill_tp},
            "decode": {"instances": decode_instances, "tp": decode_tp},
            "colocated": {"instances": colocated_instances, "tp": colocated_tp, **price_colocated(colocated,
                                                                                                classes).to_json()},
            "disaggregated": price_disaggregated(prefill, decode, wire, classes).to_json()}


# ---- the table -------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    """Colocated beside disaggregated, and their ratio, in plain text."""
    r, c, d = result, result["colocated"], result["disaggregated"]
    kv = kv_text(r["kv_cache_dtype"], r["dtype"])
    link = r["link"]
    lines = [f"{r['model_shape']} on {r['hardware_label']}: prompts of {r['prompt_tokens']:,} tokens, "
             f"{r['output_tokens']:,} output tokens, {r['rate']:g} requests/s ({kv} KV, chunks of "
             f"{r['chunk_tokens']:,} tokens)",
             f"{'':<18}{'colocated':>18}{'disaggregated':>18}{'disagg ÷ coloc':>16}",
             f"{'GPUs':<18}{colocated_gpus(r):>18}{disaggregated_gpus(r):>18}",
             *(row(label, c, d, key, scale, fmt) for label, key, scale, fmt in TABLE_ROWS)]
    mb = (d["kv_bytes"] or 0) / 1e6
    lines.append(f"KV per request {mb:,.1f} MB over {link['name']} at {link['bandwidth'] / 1e9:,.0f} GB/s × "
                 f"{link['lanes']} lane{'s' * (link['lanes'] != 1)}, {link['latency_s'] * 1e6:g} µs latency")
    lines.append(f"busy: colocated prompts {percent(c['utilization'].get('prefill'))} of each engine's prefill "
                 f"slot, their chunks {percent(c['utilization'].get('prefill_share'))} of its steps; "
                 f"prefill instances {percent(d['utilization'].get('prefill'))}, link "
                 f"{percent(d['utilization'].get('link'))}")
    lines += [f"{name} saturated: {p['saturated']}" for name, p in (("colocated", c), ("disaggregated", d))
              if p["saturated"]]
    return "\n".join(lines)


TABLE_ROWS = (("queue (ms)", "queue_s", 1e3, ".1f"), ("prefill (ms)", "prefill_s", 1e3, ".1f"),
              ("KV transfer (ms)", "transfer_s", 1e3, ".2f"), ("TTFT (ms)", "ttft_s", 1e3, ".1f"),
              ("TPOT (ms)", "tpot_s", 1e3, ".2f"), ("decode batch", "decode_batch", 1, ".1f"))


def row(label: str, c: dict, d: dict, key: str, scale: float, fmt: str) -> str:
    def cell(v: float | None) -> str:
        return "saturated" if v is None else format(v * scale, fmt)

    ratio = f"{d[key] / c[key]:.2f}" if c[key] and d[key] is not None else "-"
    return f"{label:<18}{cell(c[key]):>18}{cell(d[key]):>18}{ratio:>16}"


def colocated_gpus(r: dict) -> str:
    c = r["colocated"]
    return f"{c['gpus']} = {c['instances']}×tp{c['tp']}"


def disaggregated_gpus(r: dict) -> str:
    p, q = r["prefill"], r["decode"]
    return f"{r['disaggregated']['gpus']} = {p['instances']}×tp{p['tp']}+{q['instances']}×tp{q['tp']}"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"
