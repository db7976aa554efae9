"""Two runs side by side: which settings differ (from their headers) and how their figures differ.

Both answers come from what any reader of the events has (a RunRecord), so the dashboard's compare
view, a test on two recorded traces and a script agree on them. Times are engine time (RunHistory's
`Finish`), never the paced wall clock, so a run watched at 4 iterations a second compares fairly
with an unpaced one.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvscope.backend.events.history import Column
from kvscope.backend.events.record import RunRecord

# Scenario fields (besides the engine) that a comparison may vary: the workload's arrival rate.
SCENARIO_FIELDS = ("generate.arrival.rate_per_step",)


@dataclass(frozen=True)
class Row:
    """One figure of both runs; `unit` says how to print it ("" a count, "ms" engine milliseconds)."""

    label: str
    a: float | None
    b: float | None
    unit: str = ""


def prefill_tokens(record: RunRecord) -> int:
    """Prompt tokens the model computed: a prefix found in the cache is not computed again."""
    return sum(c.tokens for col in record.history.columns for c in col.cells if c.kind == "prefill")


def peak_blocks(record: RunRecord) -> int:
    """The most KV blocks held at once (the metrics' usage share times the pool size); none without a
    KV cache (its engine's scratch blocks hold nothing from one iteration to the next)."""
    if not record.state.kv_cache:
        return 0
    usage = max((p.kv_usage for p in record.history.metrics), default=0.0)
    return round(usage * (record.state.num_blocks or 0))


def bytes_per_block(record: RunRecord) -> int:
    return record.state.cache.get("bytes_per_block", 0) if record.state.kv_cache else 0


def kv_bytes_per_token(record: RunRecord) -> int:
    """What one token's keys and values take in the cache: GQA, MLA and int8 shrink it, no cache is 0."""
    block_size = record.state.cache.get("block_size")
    return bytes_per_block(record) // block_size if block_size else 0


def weight_mb(record: RunRecord) -> float | None:
    """The weights the run held, as stored (quantized, or a GGUF file's own blocks): what every decode
    step reads once. None where the header does not say (old traces, simulate mode's shapes)."""
    weights = record.state.weights or {}
    return round(weights["bytes"] / 2**20, 1) if weights.get("bytes") else None


def weights_per_rank_mb(record: RunRecord) -> float | None:
    """The weights one rank holds (rank 0's): a tensor-parallel rank holds its share of every layer plus the
    replicated embedding; a single process holds them all."""
    ranks = record.state.ranks
    return round(ranks[0]["weight_bytes"] / 2**20, 1) if ranks else weight_mb(record)


def decode_columns(record: RunRecord) -> list[Column]:
    """The iterations that only decoded (one token per sequence): the steps the weights' bytes bound.
    Prefill chunks are left out, their time grows with their tokens."""
    return [c for c in record.history.columns if c.scheduled and all(cell.kind == "decode" for cell in c.scheduled)]


def median_decode_step_ms(record: RunRecord) -> float | None:
    """The median engine time of the decode-only iterations."""
    times = [c.duration_s for c in decode_columns(record)]
    return round(1000 * statistics.median(times), 2) if times else None


def median_allreduce_ms(record: RunRecord) -> float | None:
    """The median time rank 0 spent in a decode-only step's all-reduces (waiting for the slower rank included);
    0 for a single process, which has nothing to reduce."""
    times = [c.allreduce["ms"] if c.allreduce else 0.0 for c in decode_columns(record)]
    return round(statistics.median(times), 2) if times else None


def allreduces_per_step(record: RunRecord) -> int:
    """All-reduces in a step: two per layer under tensor parallelism (attention's output and the MLP's), else none."""
    return max((c.allreduce["count"] for c in record.history.columns if c.allreduce), default=0)


def mean_ms(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(1000 * statistics.fmean(known), 2) if known else None


def compare_rows(a: RunRecord, b: RunRecord) -> list[Row]:
    """The figures a comparison is about, for run a and run b so far."""
    figures = [(r, [f.ttft_s for f in r.history.finishes], [f.tpot_s for f in r.history.finishes]) for r in (a, b)]
    (ra, ttft_a, tpot_a), (rb, ttft_b, tpot_b) = figures
    peak_mb = [round(peak_blocks(r) * bytes_per_block(r) / 2**20, 2) for r in (ra, rb)]
    tokens_per_s = [r.history.run_tokens_per_s() for r in (ra, rb)]
    # Under tensor parallelism the header's cache figures are one rank's (every rank holds its own KV heads)
    sharded = bool(ra.state.ranks or rb.state.ranks)
    per_rank = " per rank" if sharded else ""
    # Engine time is this machine's wall clock (shared, noisy: it can contradict the lesson), so it comes
    # last and says so; the page leads with the same runs priced on a GPU. Simulate mode's is modelled.
    where = "simulated" if ra.state.simulated or rb.state.simulated else "measured on this CPU"
    return [  # what the settings change first (the bytes), then what that did, then the measured times
        Row("weights", weight_mb(ra), weight_mb(rb), "MiB"),
        *([Row("weights per rank", weights_per_rank_mb(ra), weights_per_rank_mb(rb), "MiB")] if sharded else []),
        Row(f"KV bytes per token{per_rank}", kv_bytes_per_token(ra), kv_bytes_per_token(rb)),
        Row(f"bytes per block{per_rank}", bytes_per_block(ra), bytes_per_block(rb)),
        Row("peak KV blocks", peak_blocks(ra), peak_blocks(rb)),
        Row(f"peak KV{per_rank}", *peak_mb, "MB"),
        *(tensor_parallel_rows(ra, rb) if sharded else []),
        Row("iterations", ra.state.step + 1, rb.state.step + 1),
        Row("preemptions", ra.state.num_preemptions, rb.state.num_preemptions),
        Row("prefill tokens computed", prefill_tokens(ra), prefill_tokens(rb)),
        Row("finished requests", len(ra.history.finishes), len(rb.history.finishes)),
        Row(f"tokens/s ({where})", *(round(t, 1) if t is not None else None for t in tokens_per_s)),
        Row(f"mean TTFT ({where})", mean_ms(ttft_a), mean_ms(ttft_b), "ms"),
        Row(f"mean TPOT ({where})", mean_ms(tpot_a), mean_ms(tpot_b), "ms"),
        Row(f"median decode step ({where})", median_decode_step_ms(ra), median_decode_step_ms(rb), "ms"),
    ]


@dataclass(frozen=True)
class BlockCosts:
    """What a run's block size costs in bookkeeping, counted from its iterations (history columns).

    A request's blocks are ceil(context / block_size): 1-token blocks make every one of these grow with
    the tokens, 16-token ones with a sixteenth of them."""

    table_entries: int  # the most block ids the scheduled requests' tables held in one iteration
    hashed_blocks: int | None  # full blocks a prefix cache hashes (once each, as it fills); None: caching off
    gathers: int  # paged attention's block lookups, summed over every decode row of the run
    decode_rows: int


def block_costs(record: RunRecord) -> BlockCosts:
    size = record.state.cache.get("block_size") or 1
    columns = record.history.columns
    entries = max((sum(-(-c.context_len // size) for c in col.scheduled) for col in columns), default=0)
    longest: dict[str, int] = {}  # request -> its longest context on record
    for col in columns:
        for c in col.scheduled:
            longest[c.request_id] = max(longest.get(c.request_id, 0), c.context_len)
    hashed = sum(n // size for n in longest.values()) if record.state.config.get("prefix_caching") else None
    decodes = [c.context_len for col in columns for c in col.scheduled if c.kind == "decode"]
    return BlockCosts(entries, hashed, sum(-(-n // size) for n in decodes), len(decodes))


def tensor_parallel_rows(a: RunRecord, b: RunRecord) -> list[Row]:
    """What sharding adds to a step: the all-reduces that sum the ranks' partial outputs, and their time."""
    return [Row("all-reduces per step", allreduces_per_step(a), allreduces_per_step(b)),
            Row("all-reduce per decode step (rank 0)", median_allreduce_ms(a), median_allreduce_ms(b), "ms")]


def settings(record: RunRecord) -> dict[str, Any]:
    """A run's settings as dotted paths (the overrides' names, as `--set` takes them), from its header."""
    state = record.state
    flat = {f"engine.{key}": value for key, value in state.config.items()}  # speculative stays one setting
    flat["model"] = state.model.get("name")
    scenario = dict(_flatten("", state.scenario or {}))
    flat.update({path: scenario.get(path) for path in SCENARIO_FIELDS if path in scenario})
    return flat


def setting_differences(a: RunRecord, b: RunRecord) -> list[tuple[str, Any, Any]]:
    """(dotted path, a's value, b's value) of every setting the two runs' headers disagree on."""
    sa, sb = settings(a), settings(b)
    return [(path, sa.get(path), sb.get(path)) for path in sorted(sa.keys() | sb.keys())
            if sa.get(path) != sb.get(path)]


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(f"{prefix}.{key}" if prefix else key, inner)
    else:
        yield prefix, value
