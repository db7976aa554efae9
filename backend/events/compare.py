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


def median_decode_step_ms(record: RunRecord) -> float | None:
    """The median engine time of the iterations that only decoded (one token per sequence): the step the
    weights' bytes bound. Prefill chunks are left out, their time grows with their tokens."""
    times = [c.duration_s for c in record.history.columns
             if c.scheduled and all(cell.kind == "decode" for cell in c.scheduled)]
    return round(1000 * statistics.median(times), 2) if times else None


def mean_ms(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(1000 * statistics.fmean(known), 2) if known else None


def compare_rows(a: RunRecord, b: RunRecord) -> list[Row]:
    """The figures a comparison is about, for run a and run b so far."""
    figures = [(r, [f.ttft_s for f in r.history.finishes], [f.tpot_s for f in r.history.finishes]) for r in (a, b)]
    (ra, ttft_a, tpot_a), (rb, ttft_b, tpot_b) = figures
    peak_mb = [round(peak_blocks(r) * bytes_per_block(r) / 2**20, 2) for r in (ra, rb)]
    tokens_per_s = [r.history.run_tokens_per_s() for r in (ra, rb)]
    return [  # what the settings change first (the cache's bytes), then what that did
        Row("weights", weight_mb(ra), weight_mb(rb), "MiB"),
        Row("KV bytes per token", kv_bytes_per_token(ra), kv_bytes_per_token(rb)),
        Row("bytes per block", bytes_per_block(ra), bytes_per_block(rb)),
        Row("peak KV blocks", peak_blocks(ra), peak_blocks(rb)),
        Row("peak KV", *peak_mb, "MB"),
        Row("iterations", ra.state.step + 1, rb.state.step + 1),
        Row("preemptions", ra.state.num_preemptions, rb.state.num_preemptions),
        Row("median decode step (engine)", median_decode_step_ms(ra), median_decode_step_ms(rb), "ms"),
        Row("mean TTFT (engine)", mean_ms(ttft_a), mean_ms(ttft_b), "ms"),
        Row("mean TPOT (engine)", mean_ms(tpot_a), mean_ms(tpot_b), "ms"),
        Row("tokens/s (engine)", *(round(t, 1) if t is not None else None for t in tokens_per_s)),
        Row("prefill tokens computed", prefill_tokens(ra), prefill_tokens(rb)),
        Row("finished requests", len(ra.history.finishes), len(rb.history.finishes)),
    ]


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
