"""KV memory calculator: the formula, the current model's numbers, and what-if inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nicegui import ui

from kvscope.backend.config import DTYPE_BYTES, KV_SCALE_BYTES, kv_bytes_per_token
from kvscope.backend.events.state import RunState
from kvscope.frontend.client import RunFeed
from kvscope.frontend.views.base import FeedView, view_card

EXPLANATION = """
Every layer stores a **key** and a **value** vector per KV head for every token of the context:

**bytes per token = 2 · L · N_kv · D_h · bytes**  (L layers, N_kv KV heads, D_h head dim)

Multi-head attention (MHA) has as many KV heads as query heads; grouped-query attention (GQA)
shares each KV head among a group of query heads; multi-query attention (MQA) keeps one. Multi-head
latent attention (MLA, DeepSeek) caches one compressed latent plus a small rotary key per layer:

**bytes per token = L · (kv_lora_rank + qk_rope_head_dim) · bytes**

An **int8** cache stores each value in one byte plus one float32 **scale** per token and KV head
(per row: `2 · L · N_kv · (D_h · 1 + 4)` bytes per token), about a quarter of fp32. Quantized
**weights** (int8, int4 in groups sharing one scale) shrink the model itself, not the cache.

Multiply by the context length and the number of sequences for the memory a batch needs; this is
what limits batch size and context length on a real GPU.

Split over **tensor-parallel** ranks, each rank caches only its own KV heads (N_kv / ranks of them;
with fewer KV heads than ranks, each head is copied to several), so its bytes per token shrink with
the ranks, and so do its weights: a share of every layer, while the embedding stays whole on each.
"""

@dataclass
class KvInputs:
    variant: str = "gqa"  # mha | gqa | mqa | mla
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    latent: int = 64  # kv_lora_rank + qk_rope_head_dim (MLA)
    bytes_per_value: int = 4
    scales: bool = False  # int8: plus one scale per stored row
    context: int = 1024
    sequences: int = 8


def _kv_heads(x: KvInputs) -> int:
    return {"mha": x.n_heads, "mqa": 1}.get(x.variant, x.n_kv_heads)


def bytes_per_token(x: KvInputs) -> int:
    rows, row_values = (1, x.latent) if x.variant == "mla" else (2 * _kv_heads(x), x.head_dim)
    return kv_bytes_per_token(x.n_layers, rows, row_values, x.bytes_per_value, x.scales)


def formula_text(x: KvInputs) -> str:
    if x.variant == "mla":
        row = f"({x.latent} · {x.bytes_per_value} B + {KV_SCALE_BYTES} B scale)" if x.scales \
            else f"{x.latent} · {x.bytes_per_value} B"
        return f"{x.n_layers} · {row}"
    row = f"({x.head_dim} · {x.bytes_per_value} B + {KV_SCALE_BYTES} B scale)" if x.scales \
        else f"{x.head_dim} · {x.bytes_per_value} B"
    return f"2 · {x.n_layers} · {_kv_heads(x)} · {row}"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def span_text(name: str, span: list[int]) -> str:
    """A tensor-parallel rank's [start, end) of heads in words: "KV head 1", "query heads 4–7"."""
    start, end = span
    return f"{name} {start}" if end - start == 1 else f"{name}s {start}–{end - 1}"


def inputs_from_header(model: dict, cache: dict) -> KvInputs:
    formula = cache.get("formula") or {}
    variant = model.get("attention", "gqa")
    int8 = cache.get("dtype") == "int8"
    return KvInputs(variant=variant, n_layers=model.get("n_layers", 1), n_heads=model.get("n_heads", 1),
                    n_kv_heads=model.get("n_kv_heads", 1), head_dim=model.get("head_dim", 1),
                    latent=formula.get("values_per_token_per_layer", 64) if variant == "mla" else 64,
                    bytes_per_value=1 if int8 else
                    formula.get("bytes_per_value") or DTYPE_BYTES.get(model.get("dtype", ""), 4), scales=int8)


def weights_text(weights: dict | None) -> str:
    """Weight bytes as run, and against the unquantized model when quantized."""
    if not weights:
        return ""
    quant = weights.get("quant") or "none"
    size, full = weights.get("bytes", 0), weights.get("bytes_unquantized", 0)
    ratio = f", {full / size:.1f}× smaller" if size else ""
    if weights.get("gguf"):  # a GGUF file run as it stores its weights (docs/quantization.md)
        layers = ", ".join(f"{n} {kind}" for kind, n in weights.get("layers", {}).items())
        return f"weights as the GGUF file stores them ({layers}): {human(size)} (float32 {human(full)}{ratio})"
    if quant == "none":
        return f"weights unquantized: {human(weights.get('bytes', 0))}"
    group = f" in groups of {weights['group_size']}" if weights.get("group_size") else " per tensor"
    return f"weights {quant}{group}: {human(size)} (unquantized {human(full)}{ratio})"


def kv_dtype_text(model: dict, cache: dict) -> str:
    """The cache's dtype and what it costs per token."""
    dtype = cache.get("dtype") or model.get("dtype", "?")
    scales = " + a float32 scale per token and KV head" if dtype == "int8" else ""
    return f"KV cache {dtype}{scales}: {model.get('kv_bytes_per_token', 0):,} B per token"


def draft_text(draft: dict | None) -> str:
    if not draft:
        return ""
    return (f"draft {draft.get('name')}: {draft.get('n_layers')} layers, {draft.get('kv_bytes_per_token', 0):,} B "
            f"per token, {human(draft.get('bytes_per_block', 0))} per block")


def ranks_text(state: RunState) -> str:
    """What each tensor-parallel rank holds of the weights ("" for one process)."""
    if not state.ranks:
        return ""
    embedding = (state.tensor_parallel or {}).get("embedding", "replicated")
    return (f"split over {len(state.ranks)} ranks: {human(state.ranks[0]['weight_bytes'])} of weights on each "
            f"(a share of every layer, the embedding {embedding})")


def memory_text(state: RunState) -> str:
    """Weights, ranks, KV dtype and the draft model of a run, in one line (metrics view, calculator)."""
    if not state.model:
        return ""
    kv = kv_dtype_text(state.model, state.cache) + (" on each rank" if state.ranks else "")
    parts = (weights_text(state.weights), ranks_text(state), kv, draft_text(state.draft_model))
    return " · ".join(p for p in parts if p)


def current_model_text(model: dict, cache: dict, ranks: Sequence[dict] = ()) -> str:
    """The header's own numbers: formula, bytes per token, per block and for the whole pool; under tensor
    parallelism the cache's figures are rank 0's and the formula the whole model's, so both are said."""
    formula = cache.get("formula") or {}
    per_token = model.get("kv_bytes_per_token", 0)
    per_block, n = cache.get("bytes_per_block", 0), cache.get("num_blocks", 0)
    values = formula.get("values_per_token_per_layer")
    detail = f" ({formula.get('n_layers')} layers × {values} values × {formula.get('bytes_per_value')} B)" \
        if values else ""
    whole = formula["n_layers"] * values * formula["bytes_per_value"] + formula.get("scale_bytes_per_token", 0) \
        if values and ranks else per_token
    head = (f"**{model.get('name', '?')}** ({model.get('attention', '?').upper()}, {model.get('n_heads')} query / "
            f"{model.get('n_kv_heads')} KV heads, head dim {model.get('head_dim')}, {model.get('dtype')}): "
            f"`{formula.get('text', '2 x L x N_kv x D_h x bytes')}` = **{whole:,} B per token**{detail}; ")
    if not ranks:
        return head + f"a block of {cache.get('block_size')} tokens = {human(per_block)}; " \
                      f"the pool of {n} blocks = {human(per_block * n)}."
    return head + (f"split over {len(ranks)} ranks, rank 0 caches {span_text('KV head', ranks[0]['kv_heads'])}: "
                   f"**{per_token:,} B per token**, a block of {cache.get('block_size')} tokens = {human(per_block)}, "
                   f"its pool of {n} blocks = {human(per_block * n)}; every rank holds a pool like it.")


class KvCalculatorView(FeedView):
    name = "kv_calc"

    def __init__(self, feed: RunFeed) -> None:
        self.inputs = KvInputs()
        self.fields: dict[str, ui.number] = {}
        with view_card("KV memory calculator", EXPLANATION, "w-full"):
            self.model_text = ui.markdown("").classes("kv-small").mark("kv-model")
            self.memory = ui.label("").classes("kv-small").mark("kv-memory")
            with ui.row().classes("items-end gap-2"):
                self.variant = ui.select({"mha": "MHA", "gqa": "GQA", "mqa": "MQA", "mla": "MLA"}, label="attention",
                                         value=self.inputs.variant, on_change=self.compute).classes("w-20") \
                    .mark("kv-variant")
                for field, label in (("n_layers", "L layers"), ("n_heads", "query heads"),
                                     ("n_kv_heads", "N_kv"), ("head_dim", "D_h"), ("latent", "MLA latent + rope"),
                                     ("bytes_per_value", "bytes/value"), ("context", "context tokens"),
                                     ("sequences", "sequences")):
                    self.fields[field] = ui.number(label, value=getattr(self.inputs, field), min=1, precision=0,
                                                   on_change=self.compute).classes("w-24").mark(f"kv-{field}")
                self.scales = ui.switch("int8 + scales", value=self.inputs.scales, on_change=self.compute) \
                    .mark("kv-scales").tooltip("one float32 scale per token and KV head, as an int8 cache keeps")
            self.result = ui.markdown("").classes("kv-result").mark("kv-result")
            ui.button("use this run's model", on_click=self.load_model).props("flat dense size=sm") \
                .mark("kv-load-model")
        self.compute()
        super().__init__(feed)

    def full(self) -> bool:
        state = self.feed.state
        if not state.model:
            return False
        self.model_text.set_content(current_model_text(state.model, state.cache, state.ranks))
        self.memory.set_text(memory_text(state))
        self.load_model()
        return True

    def delta(self, entries) -> bool:
        return False  # the model and cache only change with a new header, which comes as a resync

    def load_model(self) -> None:
        state = self.feed.state
        if state is None or not state.model:
            return
        loaded = inputs_from_header(state.model, state.cache)
        self.variant.value = loaded.variant
        self.scales.value = loaded.scales
        for field, element in self.fields.items():
            if field not in ("context", "sequences"):
                element.value = getattr(loaded, field)
        self.compute()

    def compute(self) -> None:
        x = self.inputs
        x.variant = self.variant.value or "gqa"
        x.scales = bool(self.scales.value)
        for field, element in self.fields.items():
            setattr(x, field, _int(element.value))
        per_token = bytes_per_token(x)
        total = per_token * x.context * x.sequences
        self.result.set_content(
            f"{formula_text(x)} = **{per_token:,} B per token** · × {x.context:,} tokens × {x.sequences} "
            f"sequences = **{human(total)}**")


def _int(value: float | None) -> int:
    return max(1, int(value or 1))
