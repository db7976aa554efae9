"""A lesson step's text filled from the run it is shown beside: `{name}` placeholders, each run's own values.

A scenario's lesson is fixed prose, but side by side it is shown twice, beside two runs that differ in
one setting: "3,072 bytes per token" is true of the GQA column and false of the MHA one beside it. So a
text names what a compare axis changes as a placeholder (`{kv_bytes_per_token}`) and every reader fills
it from its own run's header: the lesson card (frontend/lesson.py), the exported slides and the handout
(frontend/export/). The names are backend/scenario.py's LESSON_FIELDS, which refuses a text naming
another at load; the values are here. docs/scenarios.md#lesson-placeholders lists them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvscope.backend.events.state import RunState
from kvscope.backend.scenario import PLACEHOLDER

Header = dict[str, Any]  # a header event, or a RunState's fields of the same names (header_of)
UNKNOWN = "–"  # a value this run's header does not hold (an old trace): the text still reads


def header_of(state: RunState) -> Header:
    """A reduced run's header fields, under the header event's names."""
    return {"scenario": state.scenario, "config": state.config, "model": state.model, "cache": state.cache,
            "weights": state.weights, "tensor_parallel": state.tensor_parallel}


def count(value: Any) -> str | None:
    """An integer as the texts write them: thousands separated (12,288)."""
    return f"{int(value):,}" if isinstance(value, (int, float)) else None


def on_off(value: Any) -> str | None:
    return None if value is None else ("on" if value else "off")


def dig(header: Header, *path: str) -> Any:
    """header[a][b]...; None where a part is missing (an old trace, simulate mode's shapes)."""
    value: Any = header
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def kv_shape(header: Header) -> str | None:
    """What one token leaves per layer: KV heads of a head dim, or MLA's latent and its RoPE key."""
    mla = dig(header, "model", "config", "mla")
    if mla:
        return f"a latent of {mla['kv_lora_rank']} plus a RoPE key of {mla['qk_rope_head_dim']}"
    heads, dim = dig(header, "model", "n_kv_heads"), dig(header, "model", "head_dim")
    if heads is None or dim is None:
        return None
    return f"{heads} KV head{'s' if heads != 1 else ''} of {dim}"


def speculative(header: Header) -> str | None:
    """How tokens are proposed: "off", "a draft model (demo-draft) proposing 4 tokens", "n-gram lookup ..."."""
    config = header.get("config") or {}
    if "speculative" not in config:
        return None
    spec = config["speculative"]
    if not spec:
        return "off"
    drafter = f"a draft model ({spec.get('draft_model')})" if spec.get("method") == "draft" else "n-gram lookup"
    return f"{drafter} proposing {spec.get('num_tokens')} tokens"


def weights_mib(header: Header) -> str | None:
    """The weights as the run held them (quantized, or a GGUF file's own blocks), in MiB."""
    size = dig(header, "weights", "bytes")
    return f"{size / 2**20:,.1f}" if size else None


def ranks(header: Header) -> str | None:
    return count(dig(header, "config", "tensor_parallel"))


def model_name(header: Header) -> str | None:
    name = dig(header, "model", "name")
    return Path(str(name).rstrip("/")).name if name else None  # a model folder by its last part


def instances(header: Header) -> str | None:
    """Where prefill and decode run: one engine, or a disaggregated run's instances."""
    config = dig(header, "config")
    if not isinstance(config, dict):
        return None
    split = config.get("disaggregation")
    if not isinstance(split, dict):
        return "one engine (colocated)"
    p, d = split.get("prefill_instances"), split.get("decode_instances")
    return f"{p} prefill and {d} decode instance{'s' if d != 1 else ''} (disaggregated)"


def arrival_rate(header: Header) -> str | None:
    rate = dig(header, "scenario", "generate", "arrival", "rate_per_step")
    return f"{rate:g}" if isinstance(rate, (int, float)) else None


# name -> its value from a header; None where the header does not hold it
FIELDS: dict[str, Callable[[Header], str | None]] = {
    "model": model_name,
    "attention": lambda h: str(dig(h, "model", "attention") or "").upper() or None,  # MHA, GQA, MQA, MLA
    "n_layers": lambda h: count(dig(h, "model", "n_layers")),
    "n_heads": lambda h: count(dig(h, "model", "n_heads")),
    "n_kv_heads": lambda h: count(dig(h, "model", "n_kv_heads")),
    "head_dim": lambda h: count(dig(h, "model", "head_dim")),
    "kv_shape": kv_shape,
    "kv_dtype": lambda h: dig(h, "cache", "dtype"),
    "kv_bytes_per_token": lambda h: count(dig(h, "model", "kv_bytes_per_token")),
    "bytes_per_block": lambda h: count(dig(h, "cache", "bytes_per_block")),
    "block_size": lambda h: count(dig(h, "cache", "block_size")),
    "num_blocks": lambda h: count(dig(h, "cache", "num_blocks")),
    "batching": lambda h: dig(h, "config", "batching"),
    "kv_layout": lambda h: dig(h, "config", "kv_layout"),
    "kv_cache": lambda h: on_off(dig(h, "config", "kv_cache")),
    "prefix_caching": lambda h: on_off(dig(h, "config", "prefix_caching")),
    "chunked_prefill": lambda h: on_off(dig(h, "config", "chunked_prefill")),
    "token_budget": lambda h: count(dig(h, "config", "max_num_batched_tokens")),
    "arrival_rate": arrival_rate,
    "speculative": speculative,
    "weights_mib": weights_mib,
    "ranks": ranks,
    "batch_invariant": lambda h: on_off(dig(h, "config", "batch_invariant")),
    "hidden_size": lambda h: count(dig(h, "model", "config", "hidden_size")),
    "instances": instances,
}


def lesson_values(header: Header) -> dict[str, str | None]:
    """Every field's value for this run."""
    return {name: value(header) for name, value in FIELDS.items()}


def fill(text: str, header: Header) -> str:
    """The text with each `{name}` replaced by this run's value (UNKNOWN where its header lacks it)."""
    values = lesson_values(header)
    return re.sub(PLACEHOLDER, lambda m: values.get(m.group(1)) or UNKNOWN, text)
